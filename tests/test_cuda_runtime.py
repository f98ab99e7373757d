"""The run-time CUDA compiler (attnx._C_nvrtc, csrc/rtc/; python/attnx/_cuda_runtime.py) on a machine without
a GPU: the embedded sources compiled by the NVRTC beside torch to SASS for an exact architecture, the disk
cache (its keys, its entries' checks, concurrent writers, eviction, a folder it must refuse), and the errors
where NVRTC or the driver is missing. tests/test_cuda_nvrtc.py compiles every instantiation to PTX; this
compiles one of each file to a cubin through the library, as a call will. tests/test_sass.py compares what
it compiles with the prebuilt library's kernels, instruction by instruction.

Marked `floor`: the floor venv of `make test-wheel` runs it with torch 2.10's NVRTC 12.8 (CUDA 12), under
which the prebuilt CUDA library (CUDA 13) does not load.
"""

import os
import stat
import subprocess
import sys
import warnings

import pytest
import torch

import attnx  # noqa: F401  (loads the schemas)
from attnx import _cuda_runtime

pytestmark = pytest.mark.floor

# One instantiation of each embedded source: (file, name expression).
KERNELS = [
    ("attention_kernel.cu", "attnx::cuda::attention_forward_simt<float, 64, 4>"),
    ("attention_kernel_mma.cu", "attnx::cuda::attention_forward_mma<__half, 64, 0>"),
    ("attention_backward_kernel.cu", "attnx::cuda::attention_backward_keys<__nv_bfloat16, 64>"),
    ("attention_backward_kernel_mma.cu", "attnx::cuda::attention_backward_mma_queries<__half, 64, 1>"),
]
SOURCE, KERNEL = KERNELS[1]


def _skip_without_compiler():
    why = _cuda_runtime.missing()
    if why:
        pytest.skip(why)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder, configured for this test (the compiler's memory emptied)."""
    _skip_without_compiler()
    folder = tmp_path / "cache"
    monkeypatch.setenv("ATTNX_CUDA_CACHE", str(folder))
    monkeypatch.delenv("ATTNX_CUDA_CACHE_MAX_BYTES", raising=False)
    state = _cuda_runtime.configure(reconfigure=True)
    assert state["cache"] == str(folder) and state["refused"] == ""
    return folder


def _entry(folder, key):
    with open(folder / f"{key}.kernel", "rb") as f:
        data = f.read()
    head, image = data.split(b"\n\n", 1)
    return dict(line.split(" ", 1) for line in head.decode().splitlines()[1:]), image


def _entries(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("source, kernel", KERNELS, ids=[k[0] for k in KERNELS])
def test_each_source_compiles_to_a_cubin_for_the_exact_arch(cache, source, kernel, arch):
    origin, key, lowered = _cuda_runtime.compile(source, kernel, arch)
    assert origin == "compiled"
    fields, image = _entry(cache, key)
    assert fields["key"] == key and fields["name"] == lowered
    # A CUDA cubin (ELF, OS ABI 0x33 from CUDA 12's NVRTC, 0x41 from 13's) whose symbols hold the kernel
    # under the lowered name the driver will look up, built for the arch asked: e_flags hold the SM version,
    # in bits 8-15 from CUDA 13's ELF ABI version 8, in bits 0-7 before.
    assert image[:4] == b"\x7fELF" and image[7] in (0x33, 0x41)
    assert lowered.encode() + b"\0" in image
    flags = int.from_bytes(image[48:52], "little")
    assert (flags >> 8 if image[8] >= 8 else flags) & 0xFF == arch
    assert _cuda_runtime.compile(source, kernel, arch)[0] == "memory"


def test_a_gpu_newer_than_nvrtc_gets_ptx_for_the_newest_arch_it_knows(cache):
    # The driver compiles PTX for its GPU: a torch whose NVRTC predates the GPU (CUDA 12.6 on sm_120) still
    # runs. The options name the virtual architecture; the entry holds PTX text, terminated as the driver
    # reads it.
    options = torch.ops.attnx._cuda_runtime_options(990)
    (target,) = [o.split("=", 1)[1] for o in options if o.startswith("--gpu-architecture=")]
    assert target.startswith("compute_") and 75 <= int(target.removeprefix("compute_")) < 990
    assert "--gpu-architecture=sm_90" in torch.ops.attnx._cuda_runtime_options(90)
    origin, key, lowered = _cuda_runtime.compile(SOURCE, KERNEL, 990)
    assert origin == "compiled"
    image = _entry(cache, key)[1]
    assert image.endswith(b"\0") and b"\0" not in image[:-1]
    assert f".target sm_{target.removeprefix('compute_')}".encode() in image
    assert f".entry {lowered}(".encode() in image


def test_the_disk_cache_serves_a_new_process(cache):
    _, key, lowered = _cuda_runtime.compile(SOURCE, KERNEL, 90)
    _cuda_runtime.configure(reconfigure=True)  # the memory emptied, as in a process started afresh
    assert _cuda_runtime.compile(SOURCE, KERNEL, 90) == ("disk", key, lowered)
    assert _cuda_runtime.cache_usage() == (1, (cache / f"{key}.kernel").stat().st_size)


def test_keys_name_the_instantiation_the_arch_and_the_headers(cache, tmp_path, monkeypatch):
    keys = {_cuda_runtime.compile(SOURCE, KERNEL, 90)[1], _cuda_runtime.compile(SOURCE, KERNEL, 80)[1],
            _cuda_runtime.compile(SOURCE, KERNEL.replace("64", "32"), 90)[1]}
    assert len(keys) == 3
    assert _cuda_runtime.compile(SOURCE, KERNEL, 90)[1] in keys  # the same call, the same key
    # Other headers' folders are another compile: a key of its own.
    extra = tmp_path / "include"
    extra.mkdir()
    found = _cuda_runtime.include_dirs()
    monkeypatch.setattr(_cuda_runtime, "include_dirs", lambda: [*found, str(extra)])
    _cuda_runtime.configure(reconfigure=True)
    assert _cuda_runtime.compile(SOURCE, KERNEL, 90)[1] not in keys


@pytest.mark.parametrize("damage", ["flipped", "truncated", "another key", "empty"])
def test_an_entry_that_does_not_verify_is_compiled_again(cache, damage):
    key = _cuda_runtime.compile(SOURCE, KERNEL, 90)[1]
    path = cache / f"{key}.kernel"
    data = path.read_bytes()
    if damage == "flipped":  # one bit of the cubin
        data = data[:-100] + bytes([data[-100] ^ 0x10]) + data[-99:]
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "another key":  # a valid entry of another kernel under this one's name
        _, other, _ = _cuda_runtime.compile(SOURCE, KERNEL, 80)
        data = (cache / f"{other}.kernel").read_bytes()
    else:
        data = b""
    path.write_bytes(data)
    _cuda_runtime.configure(reconfigure=True)
    # (A kernel in an anonymous namespace is lowered to a name NVRTC draws anew for each compile.)
    origin, again, lowered = _cuda_runtime.compile(SOURCE, KERNEL, 90)
    assert (origin, again) == ("compiled", key)
    fields, image = _entry(cache, key)  # written again, whole
    assert fields["name"] == lowered and image[:4] == b"\x7fELF" and lowered.encode() + b"\0" in image


def test_processes_compiling_the_same_kernel_at_once(cache):
    script = ("import attnx; from attnx import _cuda_runtime as r; "
              f"print(r.compile({SOURCE!r}, {KERNEL!r}, 90)[1])")
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "ATTNX_CUDA_CACHE": str(cache)})
             for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err for _, err in outs]
    keys = {out.strip() for out, _ in outs}
    assert len(keys) == 1
    key = keys.pop()
    assert _entries(cache) == [f"{key}.kernel"]  # one entry, no temporary file left
    assert _entry(cache, key)[1][:4] == b"\x7fELF"


def test_the_least_recently_used_entries_go_past_the_bound(cache, monkeypatch):
    first = _cuda_runtime.compile(SOURCE, KERNEL, 80)[1]
    size = (cache / f"{first}.kernel").stat().st_size
    monkeypatch.setenv("ATTNX_CUDA_CACHE_MAX_BYTES", str(int(2.5 * size)))
    _cuda_runtime.configure(reconfigure=True)
    second = _cuda_runtime.compile(SOURCE, KERNEL, 90)[1]
    # Read from disk, the first is the most recently used now; a third entry leaves the bound to the two
    # most recently used.
    os.utime(cache / f"{second}.kernel", (1, 1))
    _cuda_runtime.configure(reconfigure=True)
    assert _cuda_runtime.compile(SOURCE, KERNEL, 80)[0] == "disk"
    third = _cuda_runtime.compile(SOURCE, KERNEL.replace("64", "32"), 90)[1]
    assert _entries(cache) == sorted([f"{first}.kernel", f"{third}.kernel"])


def _refused(monkeypatch, folder):
    monkeypatch.setenv("ATTNX_CUDA_CACHE", str(folder))
    with pytest.warns(RuntimeWarning, match="cache is not used") as record:
        state = _cuda_runtime.configure(reconfigure=True)
    assert state["cache"] == "" and state["refused"]
    assert _cuda_runtime.cache_usage() is None
    # The kernels are compiled in memory; nothing is written to the folder.
    assert _cuda_runtime.compile(SOURCE, KERNEL, 90)[0] == "compiled"
    return str(record[0].message)


def test_a_folder_others_may_write_is_refused(cache, monkeypatch):
    cache.chmod(0o777)
    assert "writable by other users (mode 777" in _refused(monkeypatch, cache)
    assert _entries(cache) == []
    cache.chmod(0o775)
    assert "writable by other users (mode 775" in _refused(monkeypatch, cache)


def test_a_folder_of_another_user_is_refused(cache, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    os.chown(cache, 65534, 65534)
    assert "belongs to another user (uid 65534" in _refused(monkeypatch, cache)
    assert _entries(cache) == []


def test_a_missing_folder_is_created_private(cache, monkeypatch):
    folder = cache / "a" / "b"
    monkeypatch.setenv("ATTNX_CUDA_CACHE", str(folder))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _cuda_runtime.configure(reconfigure=True)["cache"] == str(folder)
    for path in (cache / "a", folder):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_a_file_in_place_of_the_folder_is_refused(cache, monkeypatch, tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    assert "is not a folder" in _refused(monkeypatch, path)


def test_no_disk_cache_when_asked(cache, monkeypatch):
    monkeypatch.setenv("ATTNX_CUDA_CACHE", "0")
    state = _cuda_runtime.configure(reconfigure=True)
    assert state["cache"] == "" and state["refused"] == ""
    assert _cuda_runtime.compile(SOURCE, KERNEL, 90)[0] == "compiled"
    assert _entries(cache) == []


def test_the_nvrtc_of_torchs_cuda_major(cache):
    version = _cuda_runtime.configure()["nvrtc"]
    assert version.split(".")[0] == torch.version.cuda.split(".")[0]


def test_errors_name_what_is_wrong(cache):
    with pytest.raises(RuntimeError, match="no CUDA source named 'nothing.cu'"):
        _cuda_runtime.compile("nothing.cu", KERNEL, 90)
    with pytest.raises(RuntimeError, match=r"could not compile attnx::cuda::attention_forward_mma<int, 64, 0>"
                                           r"[\s\S]*error"):
        _cuda_runtime.compile(SOURCE, "attnx::cuda::attention_forward_mma<int, 64, 0>", 90)
    with pytest.raises(RuntimeError, match="compiles for no architecture at or below sm_1"):
        _cuda_runtime.compile(SOURCE, KERNEL, 1)
    with pytest.raises(RuntimeError, match="cannot open NVRTC \\(/nonexistent/libnvrtc.so.13\\)"):
        torch.ops.attnx._cuda_runtime_configure("/nonexistent/libnvrtc.so.13", "", "", 0)
    # The failed configuration left the working one in place.
    assert _cuda_runtime.compile(SOURCE, KERNEL, 90)[0] in ("memory", "compiled")


def test_no_driver_is_a_clear_error():
    _skip_without_compiler()
    _cuda_runtime.load()
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver")
    with pytest.raises(RuntimeError, match="no CUDA driver: libcuda.so.1 cannot be opened"):
        torch.ops.attnx._cuda_runtime_driver()
