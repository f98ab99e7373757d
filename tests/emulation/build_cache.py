"""The emulators' content-addressed build cache (emulator.py: the CUDA kernels; metal_emulator.py: the Metal
kernels): a build is named by the hash of the compiler, its version, the flags and the bytes of every file it
depends on, under ``build/emulation/``, and is reused until one of them changes."""

import contextlib
import fcntl
import hashlib
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# ATTNX_EMULATION_CACHE: another tree's cache. `make sanitize` runs a copy of the tree and shares the main
# tree's, so that a library both build with the same flags (the Metal kernels', which the sanitizers do not
# instrument) is built once: names hash paths relative to their tree.
BUILD_DIR = os.environ.get("ATTNX_EMULATION_CACHE") or os.path.join(ROOT, "build", "emulation")


class BuildFailed(RuntimeError):
    """The compiler failed; ``stderr`` holds what it said."""

    def __init__(self, message, stderr):
        super().__init__(message)
        self.stderr = stderr


@contextlib.contextmanager
def _locked(path):
    """Holds an exclusive lock on ``path`` (created if missing): one process builds, the others (pytest-xdist
    workers) wait for its result rather than compiling the same library beside it."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def cached_build(prefix, cxx, flags, sources, depends, *, cxx_sources=(), libraries=(), shared, what,
                 unavailable):
    """The path of ``prefix-<hash>`` (``.so`` when ``shared``) in BUILD_DIR, built unless it is there already:
    each of ``sources`` compiled by ``cxx`` with ``flags`` into an object of its own, on every core at once
    (``cxx_sources``, among them, as C++ whatever their extension: .cu and .metal files), then linked with
    ``libraries`` after the objects (a linker that drops unneeded libraries reads left to right). The hash
    covers ``cxx``, its version, ``flags``, ``libraries``, the ``sources`` named (paths in the tree relative
    to it), and the bytes of ``depends`` and ``sources``. A compiler that does not run raises
    ``unavailable``; a failed compile raises BuildFailed, which names ``what`` was being built."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    except OSError as e:
        raise unavailable(f"{cxx} does not run: {e}") from e
    named = [cxx, version, *flags, *libraries, *sources]
    digest = hashlib.sha256("\0".join(x.replace(ROOT, "<root>") for x in named).encode())
    for path in [*depends, *sources]:
        with open(path, "rb") as f:
            digest.update(f.read())
    name = f"{prefix}-{digest.hexdigest()[:16]}" + (".so" if shared else "")
    target = os.path.join(BUILD_DIR, name)
    if os.path.exists(target):
        return target
    os.makedirs(BUILD_DIR, exist_ok=True)
    with _locked(target + ".lock"), tempfile.TemporaryDirectory(dir=BUILD_DIR, prefix=name + ".") as tmp:
        if os.path.exists(target):  # built by the process that held the lock before
            return target

        def run(command):
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                message = f"{what} build failed:\n{' '.join(command)}\n{result.stderr[-6000:]}"
                raise BuildFailed(message, result.stderr)

        objects = [os.path.join(tmp, f"{i}-{os.path.basename(src)}.o") for i, src in enumerate(sources)]
        compiles = [[cxx, *flags, "-c", *(["-x", "c++"] if src in cxx_sources else []), src, "-o", obj]
                    for src, obj in zip(sources, objects, strict=True)]
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(run, compiles))
        out = os.path.join(tmp, name)
        run([cxx, *flags, *objects, *libraries, "-o", out])
        os.chmod(out, 0o755)
        os.replace(out, target)  # atomic: a process that does not wait for the lock never sees half a library
    return target
