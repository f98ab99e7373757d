"""The figures of PR.md: ``python upstream/mha-b1-strides/measure.py [device]`` (default cpu).

The upstream report's shapes (B=1, Lq=32, Lkv=256, D=512, H=8, cross-attention, eval, need_weights=False):
torch's module against the patched one, and ``F.linear`` on each layout, timed interleaved (the median of
per-round ratios, so machine load moves both sides alike)."""

import pathlib
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import harness  # noqa: E402


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def per_call(fn, device, calls=50):
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - start) / calls


def interleaved(fns, device, rounds=41):
    for fn in fns.values():
        for _ in range(20):
            fn()
    samples = {name: [] for name in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in order:
            samples[name].append(per_call(fns[name], device))
    return samples


def main(device="cpu"):
    torch.manual_seed(0)
    B, Lq, Lkv, D, H = 1, 32, 256, 512, 8
    with tempfile.TemporaryDirectory() as tmp:
        files = harness.apply(pathlib.Path(__file__).resolve().parent / "patch.diff", pathlib.Path(tmp))
        patched = harness.load(files["torch/nn/modules/activation.py"], "torch.nn.modules.activation")
    original = torch.nn.MultiheadAttention(D, H, batch_first=True).to(device).eval()
    twin = patched.MultiheadAttention(D, H, batch_first=True).to(device).eval()
    twin.load_state_dict(original.state_dict())
    q = torch.randn(B, Lq, D, device=device)
    mem = torch.randn(B, Lkv, D, device=device)
    w = torch.randn(D, D, device=device)
    x = torch.randn(B, Lq, D, device=device)
    with torch.no_grad():
        expected = original(q, mem, mem, need_weights=False)[0]
        assert torch.equal(twin(q, mem, mem, need_weights=False)[0], expected)
        fns = {
            "torch 2.14.1 module": lambda: original(q, mem, mem, need_weights=False),
            "patched module": lambda: twin(q, mem, mem, need_weights=False),
            "F.linear (B,L,D) native": lambda: F.linear(x, w),
            "F.linear transpose(0,1) view": lambda: F.linear(x.transpose(0, 1), w),
            "F.linear patched view": lambda: F.linear(x.squeeze(0).unsqueeze(1), w),
        }
        samples = interleaved(fns, device)
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads; "
          f"B={B} Lq={Lq} Lkv={Lkv} D={D} H={H}, eval, need_weights=False")
    print(f"strides reaching F.multi_head_attention_forward: before {x.transpose(0, 1).stride()}, "
          f"after {x.squeeze(0).unsqueeze(1).stride()}")
    print("| call | median time (us) | ratio to torch's module / to the native F.linear (median of rounds) |")
    print("|---|---|---|")
    for name, times in samples.items():
        base = samples["torch 2.14.1 module" if "module" in name else "F.linear (B,L,D) native"]
        ratio = statistics.median(a / b for a, b in zip(times, base, strict=True))
        print(f"| {name} | {statistics.median(times) * 1e6:.1f} | {ratio:.3f}x |")


if __name__ == "__main__":
    main(*sys.argv[1:])
