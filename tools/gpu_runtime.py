"""`make gpu-check`'s runtime step: attnx's CUDA kernels compiled at run time (attnx._C_nvrtc), on a GPU.

With ATTNX_CUDA_RUNTIME_COMPILE=1 (the prebuilt library left out) and a fresh kernel cache in CACHE:

1. the first-call cost: in a fresh process, the first float16 attention call (B=2, H=8, L=S=1024, D=64),
   which compiles its kernel, then the same call again (the kernel found in the process); in a second fresh
   process, the first call again (the kernel read from the disk cache), and the prebuilt library's call
   beside it (ATTNX_CUDA_RUNTIME_COMPILE=0) for the per-call overhead;
2. the CUDA tests (pytest -m cuda) through the route, JUnit XML to JUNIT.

Prints one line `runtime-route: {json}` (the timings and the tests' counts) that tools/gpu_check.py reads.

    python tools/gpu_runtime.py --cache build/gpu-check/rtc-cache --junit build/gpu-check/runtime.xml
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check import ROOT, parse_junit  # noqa: E402  (a script beside this one)

# One call, timed in a fresh process: the first call (a compile or a cache read), then the median of 20 more.
PROBE = """
import json, time, torch, attnx
from attnx import _loader
q = torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.float16)
torch.cuda.synchronize()
t = time.perf_counter(); attnx.attention(q, q, q); torch.cuda.synchronize(); first = time.perf_counter() - t
warm = []
for _ in range(20):
    t = time.perf_counter(); attnx.attention(q, q, q); torch.cuda.synchronize()
    warm.append(time.perf_counter() - t)
print(json.dumps({"route": _loader.cuda_route(), "first_s": first, "warm_us": sorted(warm)[10] * 1e6}))
"""


def probe(env):
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:] or ["rc " + str(out.returncode)]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", required=True, help="the kernel cache folder (emptied first)")
    parser.add_argument("--junit", required=True, help="the tests' JUnit XML")
    args = parser.parse_args(argv)
    cache = os.path.abspath(args.cache)
    subprocess.run(["rm", "-rf", cache], check=True)
    env = dict(os.environ, ATTNX_CUDA_RUNTIME_COMPILE="1", ATTNX_CUDA_CACHE=cache)
    result = {"compile": probe(env), "disk_cache": probe(env),
              "prebuilt": probe(dict(env, ATTNX_CUDA_RUNTIME_COMPILE="0"))}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
                            f"--junitxml={args.junit}", "-m", "cuda"], env=env, cwd=ROOT)
    result["tests"] = parse_junit(args.junit) if os.path.exists(args.junit) else None
    print("runtime-route: " + json.dumps(result), flush=True)
    ok = tests.returncode == 0 and all("error" not in result[k] for k in ("compile", "disk_cache"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
