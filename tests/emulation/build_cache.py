"""The emulators' content-addressed build cache (emulator.py: the CUDA kernels; metal_emulator.py: the Metal
kernels): a build is named by the hash of the compiler, its version, the flags and the bytes of every file it
depends on, under ``build/emulation/``, and is reused until one of them changes."""

import hashlib
import os
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_DIR = os.path.join(ROOT, "build", "emulation")


class BuildFailed(RuntimeError):
    """The compiler failed; ``stderr`` holds what it said."""

    def __init__(self, message, stderr):
        super().__init__(message)
        self.stderr = stderr


def cached_build(prefix, cxx, flags, sources, depends, command, *, shared, what, unavailable):
    """The path of ``prefix-<hash>`` (``.so`` when ``shared``) in BUILD_DIR, compiled by ``command`` (the
    compiler with its flags and source arguments, without ``-o``) unless it is there already. The hash covers
    ``cxx``, its version, ``flags``, the ``sources`` named, and the bytes of ``depends`` and ``sources``. A
    compiler that does not run raises ``unavailable``; a failed compile raises BuildFailed, which names
    ``what`` was being built."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    except OSError as e:
        raise unavailable(f"{cxx} does not run: {e}") from e
    digest = hashlib.sha256("\0".join([cxx, version, *flags, *sources]).encode())
    for path in [*depends, *sources]:
        with open(path, "rb") as f:
            digest.update(f.read())
    name = f"{prefix}-{digest.hexdigest()[:16]}" + (".so" if shared else "")
    target = os.path.join(BUILD_DIR, name)
    if os.path.exists(target):
        return target
    os.makedirs(BUILD_DIR, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=BUILD_DIR, prefix=name + ".")
    os.close(fd)
    result = subprocess.run([*command, "-o", tmp], capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        message = f"{what} build failed:\n{' '.join(command)}\n{result.stderr[-6000:]}"
        raise BuildFailed(message, result.stderr)
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)  # atomic: concurrent test processes never see a half-written library
    return target
