"""MPS: the seed report mps-mha-b1-transposed-linear, reproduced on a Mac with attnx's Metal kernels.

(a) The report's B=1 table: ``nn.MultiheadAttention(batch_first=True)`` vs its hand-written SDPA
    composition vs ``attnx.nn.MultiheadAttention`` (whose linear and attention run attnx's Metal kernels),
    eval, no_grad, fp32, every shape of the report (bench_mha's sweep, run on "mps").
(b) The report's isolated ``F.linear`` table, B=1, L=32, E=512: each input layout through ``F.linear`` and
    ``attnx.linear``. attnx reads the B=1 transposed view ``(E, B*E, 1)`` in place, so its row should not
    differ from the native layouts.

Only for a machine with an MPS device; nothing here has run yet (no Mac in this project's CI).
"""

import attnx
import torch
import torch.nn.functional as F

from . import bench_mha
from .common import fmt_us, table, time_interleaved

DEVICES = ("mps",)
LINEAR_LAYOUTS = {  # name -> (B, L, E) tensor -> the (L, B, E) input the report times
    "(L,B,D) native": lambda x: x.transpose(0, 1).contiguous().reshape(x.shape[1], x.shape[0], x.shape[2]),
    "(B,L,D).transpose(0,1) view": lambda x: x.transpose(0, 1),
    "...transpose(0,1).reshape(L,B,D)": lambda x: x.transpose(0, 1).reshape(x.shape[1], x.shape[0], -1),
}


def run_linear(device: str, quick: bool) -> tuple:
    torch.manual_seed(0)
    B, L, E = 1, 32, 512
    x = torch.randn(B, L, E, device=device)
    w, b = torch.randn(E, E, device=device), torch.randn(E, device=device)
    rows, results = [], {}
    for name, make in LINEAR_LAYOUTS.items():
        inp = make(x)
        fns = {"F.linear": lambda inp=inp: F.linear(inp, w, b),
               "attnx.linear": lambda inp=inp: attnx.linear(inp, w, b)}
        with torch.no_grad():
            torch.testing.assert_close(fns["attnx.linear"](), fns["F.linear"](), atol=1e-3, rtol=1e-3)
            timings = time_interleaved(fns, device, reps=9 if quick else 21)
        t_ref, t_ours = timings["F.linear"], timings["attnx.linear"]
        rows.append([name, str(tuple(inp.stride())), fmt_us(t_ref.median), fmt_us(t_ours.median),
                     f"{t_ours.median / t_ref.median:.2f}x"])
        results[name] = {k: t.to_json() for k, t in timings.items()}
    text = (f"(b) F.linear vs attnx.linear, B={B} L={L} E={E}, {device} fp32\n"
            + table(["input", "strides", "F.linear us", "attnx us", "attnx/F.linear"], rows))
    return results, text


def run(device: str = "mps", quick: bool = False) -> dict:
    b1_results, b1_text = bench_mha.run_b1(device, quick)
    linear_results, linear_text = run_linear(device, quick)
    return {"results": {"b1_sweep": b1_results, "linear_layouts": linear_results},
            "text": b1_text + "\n\n" + linear_text}


if __name__ == "__main__":
    print(run()["text"])
