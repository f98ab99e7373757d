"""tools/gpu_check.py (`make gpu-check`) without a GPU: the dry run, its parsers and its summary writer.

tools/ is not part of the installed package: a copy of the tree without it (the installed-wheel CI run)
skips these tests, saying so.
"""

import json
import os
import subprocess
import sys

import pytest

from gpu_check_helpers import ROOT, TOOL, requires_tool

pytestmark = requires_tool


def test_dry_run_prints_the_plan_and_writes_the_summary(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", BUDGET="300", OUT=str(out))
    result = subprocess.run([sys.executable, TOOL, "--results-dir", str(tmp_path / "results")], env=env,
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "budget 300 s" in text
    for name, cap in [("build", 240), ("binary", 60), ("tests", 200), ("memcheck", 150), ("racecheck", 100),
                      ("synccheck", 60), ("bench", 150), ("runtime", 200)]:
        assert f"{name:10s} cap {cap:3d} s" in text, name
    (md,) = sorted((tmp_path / "results").glob("gpu-check-*-h100-80gb-hbm3-dry-run.md"))
    summary = json.loads(md.with_suffix(".json").read_text())
    assert summary["verdict"] == "FAIL" and summary["budget_s"] == 300
    assert [s["status"] for s in summary["steps"]] == ["ok", "ok", "FAIL", "ok", "ok", "TIMEOUT", "SKIPPED",
                                                       "ok"]
    assert sorted(p.name for p in out.iterdir()) == sorted([md.name, md.with_suffix(".json").name])
    assert text.rstrip().splitlines()[-1].startswith("dry run: made-up results written to")
    assert md.read_text() in text  # the summary is what is printed last


def test_summary_format(gpu_check, tmp_path):
    R = gpu_check.Result
    results = [R("env", "ok", 1.2, 30, "card"), R("build", "ok", 80.4, 240, "built"),
               R("tests", "FAIL", 61, 200, "exit 1; 3 failed | see log")]
    info = {"card": "NVIDIA H200", "capability": "9.0", "driver": "580.1", "cuda": "13.0", "nvcc": "V13.0.88",
            "torch": "2.14.1", "commit": "abc123", "date": "2026-12-01", "budget_s": 450, "total_s": 143,
            "command": "python tools/gpu_check.py"}
    extra = {"tests": {"passed": 400, "failed": 3, "errors": 0, "skipped": 2},
             "sanitizers": {"racecheck": {"errors": 0, "hazards": 2, "finished": True}}}
    summary = gpu_check.summary_json(info, results, extra)
    md_path, json_path = gpu_check.write_summary(summary, str(tmp_path), None)
    assert os.path.basename(md_path) == "gpu-check-2026-12-01-h200.md"
    assert json.loads(open(json_path).read()) == json.loads(json.dumps(summary))
    md = open(md_path).read()
    assert md.splitlines()[0] == "# gpu-check 2026-12-01: NVIDIA H200 — FAIL"
    assert "| build | ok | 80 | 240 | built |" in md
    assert "| tests | FAIL | 61 | 200 | exit 1; 3 failed \\| see log |" in md
    assert "Tests: 400 passed, 3 failed, 0 errors, 2 skipped" in md
    assert "racecheck: 0 errors, 2 hazards" in md
    assert "driver 580.1" in md and "commit abc123" in md
    assert gpu_check.overall(results[:2]) == "ok" and gpu_check.overall([]) == "FAIL"
    assert gpu_check.card_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"


# Excerpts of `cuobjdump --dump-resource-usage` (written a block an architecture) and `cuobjdump -sass` of a
# real build (names shortened to what the parser reads).
SIMT = "_ZN5attnx4cuda8_GLOBAL_22attention_forward_simtIfLi128ELi4EEEvNS_15AttentionParamsE"
SIMT16 = "_ZN5attnx4cuda8_GLOBAL_22attention_forward_simtI6__halfLi64ELi4EEEvNS_15AttentionParamsE"
MMA = "_ZN5attnx4cuda8_GLOBAL_21attention_forward_mmaI13__nv_bfloat16Li128EEEvNS_15AttentionParamsE"
SIMT_SM90 = "REG:128 STACK:24 SHARED:1024 LOCAL:0 CONSTANT[2]:120 CONSTANT[0]:1048"


def _usage_block(arch, functions):
    """One architecture's block of `cuobjdump --dump-resource-usage`: {function name: its fields}."""
    rows = "".join(f" Function {name}:\n  {fields} TEXTURE:0 SURFACE:0 SAMPLER:0\n"
                   for name, fields in functions.items())
    return ("\nFatbin elf code:\n================\n"
            f"arch = {arch}\nResource usage:\n Common:\n  GLOBAL:0\n{rows}")


USAGE = _usage_block(
    "sm_80", {SIMT: "REG:138 STACK:0 SHARED:0 LOCAL:0 CONSTANT[2]:120 CONSTANT[0]:872"},
) + _usage_block("sm_90", {
    SIMT: SIMT_SM90,
    SIMT16: SIMT_SM90,
    MMA: "REG:255 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[2]:1392 CONSTANT[0]:1000",
    "_ZN2at6native18elementwise_kernelILi128ELi2EEEviT1_": "REG:16 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:900",
})
SASS = f"""
arch = sm_90
\t\tFunction : {SIMT}
        /*0be0*/                   STL [R1+0x4], R10 ;                     /* 0x0000040a01007387 */
        /*1f10*/                   LDL R45, [R1+0x4] ;                     /* 0x00000400012d7983 */
        /*1f20*/                   LDL.64 R2, [R1+0x8] ;                   /* 0x00000400012d7983 */
\t\tFunction : {SIMT16}
        /*0be0*/                   STL [R1+0x4], R10 ;                     /* 0x0000040a01007387 */
\t\tFunction : {MMA}
        /*0100*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;   /* 0x0000000c08047237 */
        /*0110*/                   LDG.E R2, desc[UR4][R2.64] ;            /* 0x0000000402027981 */
"""


def test_kernel_report_flags_default_path_spills(gpu_check):
    # The default kernels are the library's own answers (attnx::_attention_kernel), as the binary step asks
    # them on the GPU: here an sm_90's for float32 at head dims 64 and 128, bfloat16 at 128, and the backward.
    default = gpu_check.default_kernels(["cuda mma fp32 bucket 64", "cuda simt fp32 bucket 128",
                                         "cuda mma bf16 bucket 128", "math", "cuda composite"])
    assert default == {("mma", "fp32", 64), ("simt", "fp32", 128), ("mma", "bf16", 128)}
    assert gpu_check.default_kernels(["cuda fused simt fp16 bucket 128"]) == {
        ("backward_keys", "fp16", 128), ("backward_queries", "fp16", 128)}
    assert gpu_check.default_kernels(["cuda fused mma bf16 bucket 64"]) == {
        ("backward_mma_keys", "bf16", 64), ("backward_mma_queries", "bf16", 64)}
    # the mma kernel's instantiations are one kernel of the report; torch's flash kernel is none of attnx's
    assert gpu_check.default_kernels(["cuda mma fp16 bucket 64 bits", "cuda mma bf16 bucket 32 general",
                                      "cuda mma fp32 bucket 128 capped", "torch flash fp16"]) == {
        ("mma", "fp16", 64), ("mma", "bf16", 32), ("mma", "fp32", 128)}
    rows = gpu_check.kernel_report(gpu_check.parse_resource_usage(USAGE),
                                   gpu_check.count_local_accesses(SASS), "sm_90", default)
    assert [(r["kernel"], r["dtype"], r["head_dim"]) for r in rows] == [
        ("mma", "bf16", 128), ("simt", "fp16", 64), ("simt", "fp32", 128)]
    mma, simt16, simt32 = rows
    assert (mma["registers"], mma["shared"], mma["ldl_stl"], mma["spills"]) == (255, 1024, 0, False)
    assert (simt32["registers"], simt32["stack"], simt32["ldl_stl"], simt32["spills"]) == (128, 24, 3, True)
    assert simt32["default_path"] and not simt16["default_path"]
    ok, lines = gpu_check.spill_verdict(rows)
    assert not ok
    assert lines == ["note: spills, off the default path: sm_90 simt fp16 D<=64: 1 LDL/STL, "
                     "stack 24 B, local 0 B",
                     "FAIL: spills, default path: sm_90 simt fp32 D<=128: 3 LDL/STL, stack 24 B, local 0 B"]
    assert gpu_check.spill_verdict(rows[:2])[0]  # a spill off the default path is a note only
    # Without the library's answers, every kernel counts as on the default path.
    unknown = gpu_check.kernel_report(gpu_check.parse_resource_usage(USAGE),
                                      gpu_check.count_local_accesses(SASS), "sm_90")
    assert all(r["default_path"] for r in unknown) and not gpu_check.spill_verdict(unknown[:2])[0]
    sm80 = gpu_check.kernel_report(gpu_check.parse_resource_usage(USAGE), {}, "sm_80", default)
    assert [(r["registers"], r["spills"], r["default_path"]) for r in sm80] == [(138, False, True)]
    # the fused backward's kernels are labelled as default_kernels names them
    keys = ("_ZN5attnx4cuda61_GLOBAL__N__66b1aed9_28_attention_backward_kernel_cu_d88abaac23"
            "attention_backward_keysI6__halfLi128EEEvNS_23AttentionBackwardParamsE")
    assert gpu_check.kernel_label(keys) == ("backward_keys", "fp16", 128, None)
    # the mma kernel's third template argument is its instantiation, not rows per warp
    bits = "_ZN5attnx4cuda8_GLOBAL_21attention_forward_mmaI6__halfLi64ELi1EEEvNS_15AttentionParamsE"
    assert gpu_check.kernel_label(bits) == ("mma", "fp16", 64, None)


def test_default_kernels_are_asked_of_the_library(gpu_check, device):
    # The binary step's question, asked of the device's backend: on the emulated sm_90 its answers name
    # kernels the library has (the SIMT and mma forwards, the fused backward), nothing restated here.
    if not device.cuda_like:
        pytest.skip(f"{device.backend} is not a CUDA backend")
    from attnx import info

    names = [info.attention_kernel(device, d, h, backward=b) for d in info.CUDA_DTYPES
             for h in (32, 64, 128, 256) for b in (False, True)]
    kinds = {kind for kind, _, _ in gpu_check.default_kernels(names)}
    assert {"simt", "backward_keys", "backward_queries"} <= kinds
    assert ("mma" in kinds) == (device.backend != "cuda-emu-sm75")


def test_junit_sanitizer_and_benchmark_parsers(gpu_check, tmp_path):
    xml = tmp_path / "pytest.xml"
    xml.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" failures="2" '
                   'skipped="3" tests="20"></testsuite></testsuites>')
    assert gpu_check.parse_junit(str(xml)) == {"passed": 14, "failed": 2, "errors": 1, "skipped": 3}
    log = ("ok    mma fp16\nall launches done\n========= RACECHECK SUMMARY: 2 hazards displayed "
           "(0 errors, 2 warnings)\n========= ERROR SUMMARY: 0 errors\n")
    assert gpu_check.parse_sanitizer(log) == {"errors": 0, "hazards": 2, "finished": True}
    assert gpu_check.parse_sanitizer("Killed")["errors"] is None
    results = {"cases": {
        "cuda": {"results": {"attention_throughput": {"float16 L=S=1024 D=64": {
            "attnx": {"tflops": 50.0}, "sdpa flash": {"tflops": 200.0}, "sdpa cudnn": {"tflops": 250.0},
            "sdpa math": None}, "bfloat16 L=S=1024 D=64": {
            "attnx": {"tflops": 200.0}, "attnx own": {"tflops": 80.0}, "sdpa flash": {"tflops": 200.0}}},
            "attnx_kernels": {"float16 L=S=1024 D=64": "cuda mma fp16 bucket 64",
                              "bfloat16 L=S=1024 D=64": "torch flash bf16 (own: mma bf16 bucket 64)"}}},
        "eval": {"results": {"unavoidable_bytes": 100, "attnx": {"peak_extra_bytes": 150,
                                                                  "time_over_fast_path": 2.0}}}}}
    assert gpu_check.benchmark_ratios(results) == {
        "cuda float16 L=S=1024 D=64": {"attnx_kernel": "cuda mma fp16 bucket 64", "attnx_tflops": 50.0,
                                       "best_sdpa": "sdpa cudnn",
                                       "best_sdpa_tflops": 250.0, "ratio": 0.2},
        "cuda bfloat16 L=S=1024 D=64": {"attnx_kernel": "torch flash bf16 (own: mma bf16 bucket 64)",
                                        "attnx_tflops": 200.0, "best_sdpa": "sdpa flash",
                                        "best_sdpa_tflops": 200.0, "ratio": 1.0, "attnx_own_tflops": 80.0,
                                        "own_ratio": 0.4},
        "eval attnx": {"time_over_fast_path": 2.0, "peak_over_unavoidable": 1.5}}


def test_a_step_past_its_limit_is_killed(gpu_check, tmp_path):
    log = tmp_path / "slow.log"
    rc, seconds = gpu_check.run_command([sys.executable, "-c", "import time; print('start', flush=True); "
                                         "time.sleep(60)"], str(log), 2)
    assert rc is None and seconds < 30
    assert "start" in log.read_text()
    result = gpu_check.outcome("tests", rc, seconds, 2, str(log))
    assert result.status == "TIMEOUT" and result.detail == "killed after 2 s"
    budget = gpu_check.Budget(100)
    assert budget.limit(60) == 60 and budget.limit(200) in (99 - gpu_check.RESERVE, 100 - gpu_check.RESERVE)
    assert gpu_check.Budget(20).limit(60) == 0  # too little left: the step is skipped


def test_the_runtime_steps_line(gpu_check):
    log = ("collected...\nruntime-route: " + json.dumps({
        "compile": {"route": "run-time compiled", "first_s": 1.234, "warm_us": 40.0},
        "disk_cache": {"route": "run-time compiled", "first_s": 0.05, "warm_us": 41.2},
        "prebuilt": {"route": "prebuilt", "first_s": 0.01, "warm_us": 39.6},
        "tests": {"passed": 1000, "failed": 1, "errors": 0, "skipped": 3}}) + "\n")
    found = gpu_check.parse_runtime(log)
    assert found["tests"]["failed"] == 1
    assert gpu_check.runtime_detail(found) == (
        "first call (compile) 1.23 s; first call (disk cache) 0.05 s; warm call 41 us (prebuilt 40 us); "
        "1000 passed, 1 failed, 0 errors, 3 skipped")
    assert gpu_check.parse_runtime("no line") == {}
    assert gpu_check.runtime_detail({}) == "no runtime-route line"
    failed = {"compile": {"error": ["RuntimeError: attnx: no CUDA driver"]}, "disk_cache": {}, "tests": None}
    assert gpu_check.runtime_detail(failed).startswith(
        "first call (compile): ['RuntimeError: attnx: no CUDA driver']; first call (disk cache): None")


def test_the_family_sweep_takes_the_family_s_shapes():
    # tools/gpu_family.py (gpu-check's family step) imports, and sweeps each dtype and head dim's shapes as
    # sass.mma_shape_valid (checked against the header in test_sass.py) has them; in a process of its own
    # (it sets ATTNX_CUDA_RUNTIME_COMPILE before attnx loads).
    script = """
import sys, torch
sys.path.insert(0, "tools")
import gpu_family
counts = {(d, D): sum(gpu_family.valid(s, d, D) for s in gpu_family.SHAPES)
          for d in (torch.float16, torch.float32) for D in (64, 128)}
assert counts == {(torch.float16, 64): 12, (torch.float16, 128): 4, (torch.float32, 64): 4,
                  (torch.float32, 128): 4}, counts
assert not gpu_family.valid("32x128 w4 s2", torch.float16, 64)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
