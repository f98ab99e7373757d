"""The figures of PR.md: ``python upstream/flex-dense-backward/measure.py`` (CPU).

Installed ``sdpa_dense_backward`` against the patched one, both called directly with the tensors flex's
forward HOP returns:
- dispatches: the upstream report's counter (a TorchDispatchMode counting every ``__torch_dispatch__``) at its
  shape (B=2, H=4, S=128, D=16, identity score_mod, a mask keeping everything), with its call
  (``joint_graph=None``) and with the joint graph autograd passes; plus a causal GQA case with a captured
  bias at a longer sequence, where the patch takes several tiles;
- peak memory: RSS high-water of one backward in a fresh process (inputs loaded from a file, so the
  forward's own (B, H, L, S) matrices never count; the high-water mark reset through
  /proc/self/clear_refs just before the call), minus the RSS before it (Linux only);
- time: interleaved rounds in one process, median of per-round ratios.
"""

import gc
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import test_flex_dense_backward as t  # noqa: E402

import harness  # noqa: E402

MODULE = t.MODULE


def backwards(tmp):
    files = harness.apply(HERE / "patch.diff", pathlib.Path(tmp))
    patched = t._load_changed_definitions(files[t.FILE])
    return {"original": sys.modules[MODULE].sdpa_dense_backward, "patched": patched.sdpa_dense_backward}


def case(name, B, Hq, Hkv, L, S, D, dtype=torch.float32):
    if name == "report":
        score_mod, buffers = t._score_mod("identity", Hq)
        mask = t.MASKS["none"]
    else:  # causal, a learned per-head bias
        score_mod, buffers = t._score_mod("bias", Hq)
        buffers = tuple(b.detach().to(dtype).requires_grad_() for b in buffers)
        mask = t.MASKS["causal"]
    return t._inputs(B, Hq, Hkv, L, S, D, score_mod, mask, buffers, dtype)


def count(fns, x, joint):
    out = {}
    for name, fn in fns.items():
        counter = t._Count()
        with counter:
            t._call(fn, x, joint=joint, grad_lse=False)
        out[name] = {"dispatches": counter.n, "largest_tensor_elements": counter.largest}
    return out


def child(path, variant):
    """One backward in this fresh process; prints the RSS high-water delta and the time."""
    torch.set_num_threads(int(sys.argv[4]))
    with tempfile.TemporaryDirectory() as tmp:
        fn = backwards(tmp)[variant]
        small = case("report", 1, 2, 2, 16, 16, 8)
        t._call(fn, small)  # imports, vmap and tracing machinery; negligible memory
        x = torch.load(path, weights_only=False)
        x["fw_graph"], x["joint_graph"] = small["fw_graph"], small["joint_graph"]
        if x["buffers"]:
            from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

            ex = (x["q"].new_zeros((), requires_grad=True),) + tuple(
                x["q"].new_zeros((), dtype=torch.int) for _ in range(4)
            )
            score_mod = t._score_mod("bias", x["q"].size(1))[0]
            with TransformGetItemToIndex():
                x["fw_graph"], x["joint_graph"] = sys.modules[MODULE].create_fw_bw_graph(
                    score_mod, ex, x["buffers"]
                )
        x["block_mask"] = x["block_mask"][:-1] + (t.MASKS[x.pop("mask")],)
        gc.collect()
        pathlib.Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the RSS high-water mark
        before = _status_mib("VmRSS")
        start = time.perf_counter()
        t._call(fn, x)
        elapsed = time.perf_counter() - start
        peak = _status_mib("VmHWM")
    print(json.dumps({"peak_rss_delta_mib": peak - before, "seconds": elapsed}))


def _status_mib(field):
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def fresh(x, mask, variant, threads):
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "inputs.pt"
        saved = {k: v for k, v in x.items() if k not in ("fw_graph", "joint_graph")}
        saved["block_mask"] = saved["block_mask"][:-1] + (None,)
        saved["buffers"] = tuple(b.detach().requires_grad_() for b in saved["buffers"])
        saved["mask"] = mask
        torch.save(saved, path)
        result = subprocess.run(
            [sys.executable, __file__, "child", str(path), variant, str(threads)],
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(result.stdout.strip().splitlines()[-1])


def timed(fns, x, rounds):
    samples = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        t._call(fn, x)
    for r in range(rounds):
        for name in fns if r % 2 == 0 else reversed(list(fns)):
            start = time.perf_counter()
            t._call(fns[name], x)
            samples[name].append(time.perf_counter() - start)
    ratios = [p / o for p, o in zip(samples["patched"], samples["original"], strict=True)]
    return {
        "median_s": {name: statistics.median(s) for name, s in samples.items()},
        "median_ratio_patched_over_original": statistics.median(ratios),
    }


def main():
    threads = torch.get_num_threads()
    results = {"torch": torch.__version__, "threads": threads}
    with tempfile.TemporaryDirectory() as tmp:
        fns = backwards(tmp)
        x = case("report", 2, 4, 4, 128, 128, 16)
        results["report shape, report call (joint_graph=None)"] = count(fns, x, joint=False)
        results["report shape, joint graph given"] = count(fns, x, joint=True)
        results["report shape, time"] = timed(fns, x, rounds=41)
        y = case("causal_bias", 2, 8, 2, 1024, 1024, 64)
        results["causal, GQA 8/2, captured bias, L=S=1024, D=64 (counts)"] = count(fns, y, joint=True)
        for name, shape, rounds in (
            ("report", (2, 8, 8, 2048, 2048, 64), 5),
            ("causal_bias", (2, 8, 2, 2048, 2048, 64), 5),
            ("report", (2, 8, 8, 4096, 4096, 128), 1),
        ):
            x = case(name, *shape)
            label = f"{name}, B, Hq, Hkv, L, S, D = {shape}"
            mask = "none" if name == "report" else "causal"
            results[label + " (fresh process)"] = {v: fresh(x, mask, v, threads) for v in fns}
            results[label + " (interleaved time)"] = timed(fns, x, rounds=rounds)
            print(json.dumps({label: results[label + " (fresh process)"]}), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
