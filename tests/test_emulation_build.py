"""The emulation tiers' build cache (tests/emulation/build_cache.py): a library is compiled once however many
test processes ask for it at the same time, and a failed compile says what failed."""

import os
import shutil
import threading

import pytest

from emulation import build_cache

CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++ or clang++)")


def _recording_compiler(tmp_path):
    """A compiler that records each run in the returned log, so that the test counts compiles."""
    log = tmp_path / "runs.log"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\nexec {CXX} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper), log


def _build(cxx, sources):
    return build_cache.cached_build("probe", cxx, ["-fPIC", "-shared"], [str(s) for s in sources], [],
                                    shared=True, what="probe", unavailable=RuntimeError)


def test_concurrent_builds_compile_once(tmp_path, monkeypatch):
    monkeypatch.setattr(build_cache, "BUILD_DIR", str(tmp_path / "cache"))
    sources = []
    for name in ("a", "b"):
        source = tmp_path / f"{name}.cpp"
        source.write_text(f'extern "C" int {name}() {{ return 1; }}\n')
        sources.append(source)
    cxx, log = _recording_compiler(tmp_path)
    paths, errors = [], []

    def build():
        try:
            paths.append(_build(cxx, sources))
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    (path,) = set(paths)
    runs = [run for run in log.read_text().splitlines() if run != "--version"]
    # Two compiles (one per source, run side by side) and one link, by whichever thread held the lock.
    assert sum(" -c " in run for run in runs) == 2 and len(runs) == 3, runs
    assert os.path.exists(path) and sorted(os.listdir(tmp_path / "cache")) == sorted(
        [os.path.basename(path), os.path.basename(path) + ".lock"])


def test_failed_compile_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(build_cache, "BUILD_DIR", str(tmp_path / "cache"))
    source = tmp_path / "broken.cpp"
    source.write_text("int f() { return undeclared; }\n")
    failed = r"(?s)probe build failed:.*broken\.cpp.*undeclared"
    with pytest.raises(build_cache.BuildFailed, match=failed) as e:
        _build(CXX, [source])
    assert "undeclared" in e.value.stderr
    (left,) = os.listdir(tmp_path / "cache")  # no library, no objects: the lock file alone
    assert left.endswith(".so.lock"), left
