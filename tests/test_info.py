"""`python -m attnx.info`: each line of the report against the same fact found another way (the libraries
torch loaded, the ops a call dispatches, torch's profiler, importlib)."""

import importlib.util
import itertools
import os
import subprocess
import sys

import pytest
import torch

import attnx
from attnx import _loader, info
from dispatch_helpers import DispatchRecorder


def _run(args: list[str], **env: str) -> str:
    """stdout of ``python <args>`` in a fresh process, with ``env`` added to the environment."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True,
                          env=dict(os.environ, **env)).stdout


def _info(*flags: str, **env: str) -> str:
    return _run(["-m", "attnx.info", *flags], **env)


def _line(out: str, prefix: str) -> str:
    """The report's line that starts with ``prefix`` (leading spaces ignored)."""
    return next(line.strip() for line in out.splitlines() if line.strip().startswith(prefix))


def _listed(out: str, op: str) -> dict[str, str]:
    """The backends ``op``'s line lists: backend -> ``"kernel"`` or ``"composite"``."""
    entries = _line(out, op + " ").removeprefix(op).strip()
    if entries == "none":
        return {}
    return {entry.split()[0]: "composite" if entry.endswith("(composite)") else "kernel"
            for entry in entries.split(", ")}


@pytest.fixture(scope="module")
def report() -> str:
    return _info()


def test_header(report):
    assert report.splitlines()[0] == f"attnx {attnx.__version__}"
    assert f"torch {torch.__version__}" in report
    built = importlib.util.find_spec("attnx._build_info") is not None  # absent where setup.py did not build
    assert ("backends compiled: CPU" if built else "backends compiled: unknown") in report
    assert f"loaded: {', '.join(_loader.loaded_backends())}" in report
    assert f"cuda available={torch.cuda.is_available()}" in report


def test_kernel_ops_are_those_the_routers_dispatch():
    # The report's public ops answer for the kernel ops in info.KERNEL_OPS: those the routers must choose.
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    q = k = v = torch.randn(1, 2, 3, 4)
    mha_args = (torch.randn(3, 1, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4), 2, torch.randn(12, 4), None,
                None, None, None, None, None, False, torch.randn(4, 4), None, None, None, False, None, None,
                False, True)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    varlen_args = (torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4), cu, cu, 2, 2)
    for op, args in (("linear", (x, w)), ("attention", (q, k, v)), ("mha", mha_args),
                     ("varlen_attention", varlen_args)):
        for grad in (False, True):
            with torch.set_grad_enabled(grad), DispatchRecorder() as recorder:
                getattr(torch.ops.attnx, op)(*args)
            assert set(recorder.counts) == {info.KERNEL_OPS[f"attnx::{op}"][grad]}, (op, grad)


def test_op_lines_follow_the_loaded_libraries(report):
    # Each loaded library registers kernels for _linear and _attention (the CPU one is always loaded): those
    # backends, and only those, are listed for linear and attention; mha is a composite of the two.
    loaded = set(_loader.loaded_backends())
    assert "CPU" in loaded
    for op in ("attnx::linear", "attnx::attention"):
        assert _listed(report, op) == dict.fromkeys(loaded, "kernel"), op
    for op in ("attnx::mha", "attnx::mha_backward"):
        assert _listed(report, op) == dict.fromkeys(loaded, "composite"), op
    # attention's backward: the CPU and CUDA kernels, and the composite where attention has a forward kernel.
    backward = _listed(report, "attnx::attention_backward")
    assert backward == {b: "kernel" if b in ("CPU", "CUDA") else "composite" for b in loaded}
    for backend, kind in backward.items():
        has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("attnx::attention_backward", backend)
        assert has_kernel == (kind == "kernel"), backend


def test_cpu_backward_is_fused(report):
    # The composite computes with torch's matmuls and exp, which the profiler sees; the fused kernel does not
    # call torch for its arithmetic.
    section = itertools.takewhile(lambda line: line.startswith("  "),
                                  report.split("\nbackward (")[1].splitlines()[1:])
    listed = {line.split()[0]: line.split(None, 1)[1] for line in section}
    assert listed["CPU"].startswith("fused kernel")
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    out, lse = attnx.attention(q, k, v)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        attnx.attention_backward(torch.randn_like(out), q, k, v, out, lse)
    called = {event.name for event in prof.events()}
    assert "attnx::attention_backward" in called
    assert not called & {"aten::bmm", "aten::matmul", "aten::mm", "aten::exp", "aten::softmax"}, called
    # The other backends, as the dispatcher has them: a kernel of their own, or the composite.
    assert listed.keys() == set(_loader.loaded_backends())
    for backend, text in listed.items():
        has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("attnx::attention_backward", backend)
        if backend == "CUDA":  # a kernel that runs the fused kernels or the math, per device (kernel_lines)
            assert has_kernel and text.startswith("the fused kernels or the whole-tensor math")
            continue
        assert text.startswith("fused kernel" if has_kernel else "composite"), backend


@pytest.mark.parametrize("asked", [None, "avx2", "default"])
def test_cpu_isa_line(asked):
    env = {} if asked is None else {"ATEN_CPU_CAPABILITY": asked}
    out = _run(["-c", "import torch; from attnx import info; print(torch.backends.cpu.get_cpu_capability()); "
                      "info.main([])"], **env)
    torch_level = {"AVX512": "AVX-512", "AVX2": "AVX2"}.get(out.splitlines()[0].strip(), "baseline")
    line = _line(out, "CPU attention kernels:")
    isa = line.removeprefix("CPU attention kernels:").split("(")[0].strip()
    # attnx follows torch's rule (AVX-512 with its bfloat16 products, on AMX tiles or AVX512-BF16, where the
    # CPU has them), or stays at baseline where its wider variants are not built.
    levels = {torch_level, "baseline"}
    if torch_level == "AVX-512":
        levels |= {"AVX-512 with AVX512-BF16", "AVX-512 with AMX-BF16"}
    assert isa in levels, line
    if asked == "default":
        assert isa == "baseline"
    if asked == "avx2":
        assert isa in {"AVX2", "baseline"}
    if asked is None:
        assert isa == info.cpu_isa()


@pytest.mark.parametrize("asked", ["emulated_bf16", "emulated_amx", "avx512", "no_such_level"])
def test_cpu_isa_line_asked_of_attnx(asked):
    # ATTNX_CPU_CAPABILITY: the emulation anywhere, a level no higher than the CPU's, an unknown name ignored.
    out = _run(["-c", "from attnx import info; info.main([])"], ATTNX_CPU_CAPABILITY=asked)
    line = _line(out, "CPU attention kernels:")
    assert line.endswith(f"; ATTNX_CPU_CAPABILITY={asked})"), line
    isa = line.removeprefix("CPU attention kernels:").split("(")[0].strip()
    if asked == "emulated_bf16":
        assert isa == "AVX512-BF16 emulated on the baseline ISA"
    elif asked == "emulated_amx":
        assert isa == "AMX-BF16 emulated on the baseline ISA"
    elif asked == "avx512":
        assert isa in {"AVX-512", "AVX2", "baseline"}
    else:
        assert isa == info.cpu_isa()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without a CUDA device")
def test_cuda_line_without_device(report):
    line = _line(report, "CUDA attention")
    if "CUDA" not in _loader.loaded_backends():
        assert line.startswith("CUDA attention: none (")
        return
    assert line.startswith("CUDA attention: no CUDA device visible (")
    try:
        from attnx import _build_info
    except ImportError:  # a build not made by setup.py
        archs = None
    else:
        archs = getattr(_build_info, "CUDA_ARCH_LIST", None)
    assert (f"archs {archs})" if archs else "not recorded") in line


@pytest.mark.wheel
def test_kernel_lines_name_what_the_backend_runs(device):
    # The kernel each dtype takes at each head dim, as the device's backend names it
    # (attnx::_attention_kernel): on the emulated CUDA backend, an sm_90 device's choices (choose_kernel).
    lines = info.kernel_lines(device)
    assert len(lines) == len(info.CUDA_DTYPES)
    for dtype, line in zip(info.CUDA_DTYPES, lines, strict=True):
        assert line.split()[0] == str(dtype).removeprefix("torch.")
        for d in info.KERNEL_HEAD_DIMS:
            assert f"D={d}: {info.attention_kernel(device, dtype, d)};" in line
    if device.backend == "cuda-emu":
        assert "D=64: cuda mma fp32 bucket 64; D=128: cuda mma fp32 bucket 128;" in lines[2]
        assert "D=512: cuda composite;" in lines[0]
        assert "with dropout: cuda mma fp16 bucket 64 bits" in lines[0]
        assert "backward at D=64: cuda fused mma fp16 bucket 64" in lines[0]
        assert "D=64: cuda simt fp64 bucket 64" in lines[3]
    if device.backend == "cuda-emu-sm75":
        assert all("mma" not in line for line in lines)
    if device.backend == "metal-emu":
        assert "float64 is not supported on MPS" in lines[3] and "D=512: none (" in lines[0]
    if device.backend == "cpu":
        assert f"D=64: cpu {torch.ops.attnx._cpu_capability()};" in lines[0]


def test_arch_runs():
    assert info.arch_runs("8.0;9.0", (8, 6)) is True
    assert info.arch_runs("8.0;9.0", (9, 0)) is True
    assert info.arch_runs("8.0;9.0", (7, 5)) is False
    assert info.arch_runs("8.0;9.0", (10, 0)) is False
    assert info.arch_runs("8.0 9.0+PTX", (12, 0)) is True
    assert info.arch_runs("9.0a", (9, 0)) is True
    assert info.arch_runs("9.0a", (10, 0)) is False
    assert info.arch_runs("Ampere", (8, 0)) is None
    assert info.arch_code("8.0;9.0+PTX", (9, 0)) == "cubin"
    assert info.arch_code("8.0;9.0+PTX", (8, 9)) == "cubin"
    assert info.arch_code("8.0;9.0+PTX", (10, 0)) == "ptx"
    assert info.arch_code("8.0;9.0+PTX", (12, 0)) == "ptx"
    assert info.arch_code("8.0;9.0+PTX", (7, 5)) == "none"
    assert info.arch_code("9.0a+PTX", (10, 0)) == "none"  # arch-specific PTX runs on its arch only


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_lines_name_the_kernel_that_runs(report):
    # The kernel names the profiler records (attention_forward_mma / attention_forward_simt, csrc/cuda, or
    # torch's flash_fwd_kernel) are those the report names.
    if "CUDA" not in _loader.loaded_backends():
        pytest.skip("attnx's CUDA library is not loaded")
    lines = report.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("CUDA attention on cuda:0")))
    if not lines[start].endswith(":"):
        pytest.skip(lines[start])  # attnx's kernels are not built for this GPU
    for dtype in info.CUDA_DTYPES:
        name = str(dtype).removeprefix("torch.")
        text = next(line.strip() for line in lines[start + 1:] if line.strip().startswith(name + " "))
        kernel = text.split("D=64: ")[1].split(";")[0]
        q, k, v = (torch.randn(1, 2, 64, 64, device="cuda", dtype=dtype) for _ in range(3))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            attnx.attention(q, k, v)
            torch.cuda.synchronize()
        launched = " ".join(event.name for event in prof.events())
        if kernel.startswith("torch flash"):  # torch's FlashAttention-2 (flash_fwd_kernel), none of attnx's
            assert "flash_fwd" in launched and "attention_forward" not in launched, (kernel, launched)
            continue
        expected = "attention_forward_mma" if kernel.startswith("cuda mma") else "attention_forward_simt"
        assert expected in launched, (kernel, launched)


def test_sdpa_line(report):
    assert _line(report, "SDPA takeover (attnx.sdpa): off").endswith("or attnx.sdpa.enable())")
    with attnx.sdpa.enabled():
        assert info.sdpa_line().startswith("SDPA takeover (attnx.sdpa): on:")


def test_integrations_line(report):
    line = _line(report, "integrations:")
    found, missing = set(), set()
    for part in line.removeprefix("integrations:").split(";"):
        names = [entry.split()[0] for entry in part.removeprefix(" not found:").split(",")]
        (missing if part.startswith(" not found:") else found).update(names)
    for module, _ in info.INTEGRATIONS:
        present = importlib.util.find_spec(module) is not None
        assert (module in found, module in missing) == (present, not present), (module, line)


def test_ops_flag_lists_every_op(report):
    out = _info("--ops")
    assert "attnx::_linear_autograd" not in report  # internal ops only behind the flag
    for op in info.ops():
        line = _line(out.split("ops (dispatch keys with a kernel):")[1], op + " ")
        assert line.split()[1:] == info.kernels(op)
    assert info.kernels("attnx::linear") == ["CompositeImplicitAutograd"]  # the router
    assert {"CPU", "Meta"} <= set(info.kernels("attnx::_linear"))
    assert "Autograd" not in info.kernels("attnx::_linear")
    assert {"CPU", "Meta", "Autograd"} <= set(info.kernels("attnx::_linear_autograd"))
    assert info.kernels("attnx::_cpu_capability") == ["CompositeExplicitAutograd"]


def test_the_run_time_compiler_line(tmp_path):
    from attnx import _cuda_runtime

    (tmp_path / "a.kernel").write_bytes(b"x" * 3 * 2**20)
    out = _info(ATTNX_CUDA_CACHE=str(tmp_path))
    line = _line(out, "CUDA run-time compiler:")
    why = _cuda_runtime.missing()
    if why:
        assert line == f"CUDA run-time compiler: none ({why})"
        return
    path = _cuda_runtime.nvrtc_library()[0]
    assert f"NVRTC {torch.version.cuda.split('.')[0]}." in line and f"({path})" in line
    assert f"cache {tmp_path} (1 kernels, 3.0 MiB)" in line
    if _loader.cuda_route() == "prebuilt":
        assert line.endswith("; not used: the prebuilt library serves CUDA")
    forced = _line(_info(ATTNX_CUDA_CACHE="0", ATTNX_CUDA_RUNTIME_COMPILE="1"), "CUDA run-time compiler:")
    assert "no disk cache (ATTNX_CUDA_CACHE=0)" in forced and forced.endswith("; serves CUDA in this process")
