"""`make sass`: the CUDA tensor-core kernels' instruction budget, read from the built library (no GPU needed).

For each tensor-core attention kernel of the built CUDA library (the forward's, and both passes of the
backward's; python/attnx/_C_cuda*.so, or a library, object or cubin given), on each arch in it (sm_80, sm_90),
this finds the tile loop in the kernel's SASS and counts
the instructions one iteration issues, by class, beside the registers, spills, shared memory and the occupancy
they allow; then checks the budgets below and exits 1 when one is exceeded (--report: print, never fail),
2 when it cannot check (no CUDA library, no cuobjdump or nvdisasm, no kernel matched).

    python tools/sass.py                                   # check (make sass)
    python tools/sass.py --report                          # print only (make sass SASS_ARGS=--report)
    python tools/sass.py --arch sm_90 --kernel "mma fp16 bucket64" --json build/sass.json
    python tools/sass.py --simt --report                   # the SIMT kernels too (resources; no HMMA loop)
    python tools/sass.py build/fa2.o --kernel flash_fwd_kernel --report     # any object with a fat binary

What is counted. The SASS is `nvdisasm -g -c` of each cubin (`cuobjdump -xelf` takes the cubins out of a
library or object), which names the targets of every jump table (BRX). The control-flow graph has a basic
block at every branch target and after every branch, jump, return and exit; a predicated one also falls
through. A CALL to a subroutine (a slow path) falls through and its callee is not counted (paths report their
calls); a CALL to a label of the kernel itself is a jump (sm_80 code leaves loops with CALL.REL.NOINC). Loops
are natural loops: an edge to a block that dominates its source is a back edge. The tile loop is the
innermost loop whose body holds both HMMA and the next tile's copies (LDGSTS): a loop around it (over a
block's work items: the backward's query pass looping over the batches and heads of a broadcast mask's
gradient, FA2's backward over key blocks) is not; where no loop issues copies, a loop whose body holds HMMA
and that no other HMMA-holding loop encloses. Its inner loops (mask-element loops, a window scan, an
element-wise staging loop, a chunk loop that is not unrolled) are part of its body. Where a kernel has
several (the compiler can unswitch a loop into copies), the one with the leanest steady path is reported and
their number shown.

One iteration is a path from the loop's header to a latch (a block with an edge back to the header) through
its body with every back edge removed, so an inner loop is walked once and each entry into one is counted.
Each instruction of the path counts once, predicated or not (a predicated-off instruction is issued all the
same, as Nsight Compute's inst_executed counts it). Five paths are reported:

    steady  the common case's iteration (a full, interior tile that is not the last; no mask, no soft-cap),
            the one the budgets apply to. Chosen, in order, for: the most HMMA; the most LDGSTS (the next
            tile's copies are issued); the fewest entries into inner loops; the fewest subroutine calls; the
            fewest data-dependent skips; then the fewest instructions. A data-dependent skip is a conditional
            branch straight to where its two sides join (its immediate post-dominator), jumping over a block,
            on a value that changes from tile to tile (its predicate's writes inside the loop read, back
            through the dominators, a register the loop carries or a load: a key index against the tile's
            size, a row against L): the common tile does that block's work. Any other branch, one on a kernel
            parameter or on a predicate set before the loop (a mask kind, the soft-cap, the staging mode)
            among them, takes the side with less work; so does a branch on whether the tile reads the masks
            or ends a run of FULL tiles (RUN_SOURCE): the common tile of a masked call is inside a run.
    fall    the fall-through path: at each conditional branch the side not taken, unless that side cannot
            reach a latch without leaving the loop
    min     the fewest instructions from header to latch (may skip the next tile's copies: the last tile)
    max     the most (the masked, boundary-tile, soft-capped iteration)
    bits    in the bits instantiation, the path through the load of a bool attn_mask's packed bits
            (PACKED_SOURCE) with the fewest other global loads (no key_padding_mask), then the steady rules:
            an interior tile that a bool attn_mask alone removes in part (a PARTIAL tile)

The choice is a static guess at the common case; it can be wrong where a feature switch guards LDGSTS (a
kernel copying a mask tile too would have those copies on its steady path). Per HMMA is the steady path's
instructions over its HMMA. A soft-cap branch is a conditional branch whose source line (the line table of
nvdisasm -g) mentions the soft-cap (SOFTCAP_SOURCE); the lines are read from the working tree, or with
--sources REV from the git revision the binary was built from (a note says when a source file is newer than
the binary).

Checked against an earlier hand count over the same SASS, which took "the common branches": 873
instructions per 64-key tile per warp at fp16, bucket 64, sm_90, and 1159 at bucket 128, which is what the
steady path gives for the kernel before the plain instantiation (997763950e36, and 8c203fa). Nsight
Compute on an H100 measured 877 a warp-tile at L = S = 4096, D = 64 (benchmarks/results/
ncu-2026-11-26-h100-d866bd9.txt: 1.88 IPC x 3.707 M cycles x 132 SMs / 1,048,576 warp-tiles), a dynamic
average that also spreads the prologue, the epilogue and the last tile over a warp's 64 tiles, of the kernel
at d866bd9 (853 on its unmasked path, the K and V copies alone; 994 on the steady path this rule takes, with
that variant's mask-tile copies). Figures: benchmarks/results/sass-anchor-2026-11-29.md.

The anchor is FlashAttention-2's own forward counted the same way (FA2_ANCHOR below; `make sass` prints
attnx's per-HMMA ratio to it). To measure it again: Dao-AILab/flash-attention at 0251105a with its
csrc/cutlass submodule (NVIDIA/cutlass 71275920) checked out in flash-attention/, torch's headers from .venv,
nvcc 13.0 (911 s and 789 s for the two files, both archs, on two shared cores):

    FA=flash-attention; TI=$(.venv/bin/python -c "import torch.utils.cpp_extension as c; \\
        print(c.include_paths()[0])")
    for hd in 64 128; do nvcc -c -o fa2_hdim$hd.o $FA/csrc/flash_attn/src/flash_fwd_hdim${hd}_fp16_sm80.cu \\
        -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \\
        -O3 -std=c++17 -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ \\
        -U__CUDA_NO_HALF2_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr \\
        --expt-extended-lambda --use_fast_math -lineinfo -Xcompiler -fPIC \\
        -I$FA/csrc/flash_attn -I$FA/csrc/flash_attn/src -I$FA/csrc/cutlass/include -I$TI \\
        -I$TI/torch/csrc/api/include; done
    python tools/sass.py fa2_hdim64.o fa2_hdim128.o --kernel "128x(128|64) 4w even_MN even_K$" --report

These are FA2's setup.py flags (-lineinfo adds line tables only). The filter picks the instantiation that runs
for L = S = 1024 on sm_80 and sm_90: tile 128 x 128 at D = 64 and 128 x 64 at D = 128, no dropout, causal,
local, alibi, soft-cap or returned softmax (short_name lists the flags that are true).

Standard library only, plus tools/gpu_check.py's cuobjdump helpers; cuobjdump and nvdisasm from the CUDA
toolkit or the copies triton ships beside torch; c++filt (binutils) for kernel names when present.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check  # noqa: E402  (tools/ is not a package)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------------------------------------------------
# Budgets: the steady iteration of the fp16/bf16 tensor-core kernels (BUDGETED below) at each head-dim bucket.

# Instructions per HMMA on the steady path. An FA2-shaped loop issues about 4 (FA2_ANCHOR); the scalar work
# per score (scale, max, exp, sum) weighs twice as much per HMMA at bucket 64 as at 128 (half the HMMA per
# score).
MAX_PER_HMMA = {64: 5.0, 128: 4.0}
# Kernels the budgets apply to: their short names (short_name): the fp16/bf16 tensor-core kernel, or its
# instantiation for calls without masks and soft-cap where it has one ("plain"). The steady path is the
# unmasked one.
BUDGETED = re.compile(r"^mma (fp16|bf16) bucket(64|128)( plain)?$")
# Nowhere in the tile loop's body (any path, inner loops included):
MAX_BRX = 0  # jump tables: a runtime switch (the mask dtype) that compile-time specialisation removes
MAX_LDG = 0  # global loads: the tile's operands come by LDGSTS (cp.async) into shared memory, masks too
MAX_IMUL64 = 0  # 64-bit multiplies (IMAD.WIDE, IMAD.HI): strides folded into pointer increments per tile
MAX_SOFTCAP_BRANCHES = 0  # a branch per score on the soft-cap (a template parameter instead, as FA2's)
# Every reported kernel: no local-memory traffic (LDL/STL in its SASS, or a LOCAL size).
MAX_SPILL_ACCESSES = 0

# A conditional branch whose source line (nvdisasm -g) matches this is a soft-cap test.
SOFTCAP_SOURCE = re.compile(r"soft_?cap", re.IGNORECASE)
# A branch whose source line matches this is taken by tiles that are not FULL: a tile that reads the masks
# (masks_read) or ends a run of FULL tiles (run_end, the masked instantiations'). The common tile, inside a
# run, reads no mask and searches for neither the run's end nor the next tile, so such a branch is not a
# data-dependent skip whose block the common tile does (loop_paths).
RUN_SOURCE = re.compile(r"\b(run_end|masks_read)\b")
# A global load whose source line matches this reads a bool attn_mask's packed bits (the bits
# instantiation's PARTIAL tiles): the "bits" path is the steady rules' path through it.
PACKED_SOURCE = re.compile(r"\bpacked_words\b")
# That path within this factor of the same kernel's steady path (a FULL tile: the loop without masks), in the
# bits instantiation of the fp16/bf16 kernels at the budgets' head dims (bucket 32, whose tile has a
# quarter of bucket 128's HMMA for the same work per score, is reported, not budgeted).
MAX_BITS_RATIO = 1.3
BITS_BUDGETED = re.compile(r"^mma (fp16|bf16) bucket(64|128) bits$")
# Kernels with no jump table anywhere in the tile loop: the plain and bits instantiations, forward and
# backward (the general one reads a float mask's elements through mask_value's switch).
NO_BRX = re.compile(r"^(mma|bwd keys|bwd queries) (fp16|bf16|fp32) bucket\d+ (plain|bits)$")
# Forward kernels with no soft-cap branch anywhere in the tile loop: every instantiation (the soft-cap is the
# capped one's, compiled in; the others have none).
NO_SOFTCAP = re.compile(r"^mma (fp16|bf16|fp32) bucket\d+ (plain|bits|general|capped)$")
# The forward's other tile shapes (--family): the plain loop's limits, nowhere in the loop a jump table, a
# global load, a 64-bit multiply or a soft-cap branch; their instructions per HMMA are reported.
FAMILY = re.compile(r"^mma (fp16|bf16|fp32) bucket\d+ plain \d+x\d+ w\d s\d$")

# ------------------------------------------------------------------------------------------------------------
# Occupancy: the rules of the CUDA occupancy calculator, cuda_occupancy.h of CUDA 13.0
# (cudaOccMaxBlocksPerSMRegsLimit, cudaOccMaxBlocksPerSMSmemLimit, cudaOccMaxBlocksPerMultiprocessor), with
# the device properties of the CUDA C++ Programming Guide's "Technical Specifications per Compute Capability":
#   registers  per warp = regs per thread x 32 rounded up to 256 (the allocation unit); a warp lives in one of
#              4 sub-partitions of 65536 / 4 registers each: warps per SM = 4 x floor(16384 / regs per warp);
#              blocks = floor(that / warps per block); at most 255 registers a thread
#   shared     per block = static + dynamic + 1 KiB the driver reserves per block (sm_80+), rounded up to
#              128 B; blocks = floor(shared per SM / that), with the largest carveout: 164 KiB on sm_80
#              (A100), 228 KiB on sm_90 (H100)
#   warps      64 per SM; blocks 32 per SM (sm_80, sm_90)
# Occupancy is the minimum over the three; warps per SM = blocks x warps per block.
ARCH_LIMITS = {
    "sm_80": {"regs_per_sm": 65536, "max_regs_per_thread": 255, "reg_unit": 256, "sub_partitions": 4,
              "max_warps": 64, "max_blocks": 32, "smem_per_sm": 164 * 1024, "smem_reserved": 1024,
              "smem_unit": 128},
    "sm_90": {"regs_per_sm": 65536, "max_regs_per_thread": 255, "reg_unit": 256, "sub_partitions": 4,
              "max_warps": 64, "max_blocks": 32, "smem_per_sm": 228 * 1024, "smem_reserved": 1024,
              "smem_unit": 128},
}

# ------------------------------------------------------------------------------------------------------------
# The anchor: FlashAttention-2's forward counted by this tool (the steady path of its key loop; FA2 peels its
# first, masked tile out of that loop), on the instantiation that runs for L = S = 1024 in fp16 on sm_80 and
# sm_90: flash_fwd_kernel<Flash_fwd_kernel_traits<D, 128, 128 (D = 64) or 64 (D = 128), 4 warps, false, false,
# half_t>, Is_dropout = Is_causal = Is_local = Has_alibi = false, Is_even_MN = Is_even_K = true, Is_softcap =
# Return_softmax = false> (flash_fwd_launch_template.h's run_mha_fwd_hdim64/128 for cc 8.0 and 9.0). Built
# 2026-11-29 from its flash_fwd_hdim{64,128}_fp16_sm80.cu with its setup.py's flags and nvcc 13.0 (V13.0.88),
# one file and both archs in 911 s and 789 s on two shared cores; the commands are in this docstring, the
# figures in benchmarks/results/sass-anchor-2026-11-29.md. A warp there owns 32 rows and a tile of N keys
# (warp_tile): 256 HMMA an iteration where attnx's 16 x 64 has bucket / 2 (64 at 64): compare per HMMA, not
# per tile. nvcc 13.0 runs FA2 out of registers: 255 and a stack of 136-232 bytes (spills: "ldl_stl" in the
# kernel, the steady path's in "classes"). Keyed by (arch, head dim).
FA2_COMMIT = "Dao-AILab/flash-attention 0251105a, cutlass 71275920"
FA2_NVCC = "13.0"
_FA2_CLASSES = ["HMMA", "LDSM", "LDGSTS", "MUFU.EX2", "FFMA", "FMUL", "FADD", "FMNMX", "FSEL/FSETP", "SHFL",
                "BAR/sync", "branch", "INT64", "LDS/STS", "LDL/STL", "other"]


def _fa2(warp_tile: str, instrs: int, stack: int, ldl_stl: int, counts: list) -> dict:
    """One anchor entry: `counts` are the steady path's, in _FA2_CLASSES' order (they add up to `instrs`)."""
    classes = dict(zip(_FA2_CLASSES, counts, strict=True))
    return {"warp_tile": warp_tile, "instrs": instrs, "hmma": classes["HMMA"],
            "per_hmma": round(instrs / classes["HMMA"], 2), "registers": 255, "stack": stack,
            "ldl_stl": ldl_stl, "classes": classes}


FA2_ANCHOR: dict = {
    ("sm_80", 64): _fa2("32x128", 1185, 232, 153,
                        [256, 72, 16, 132, 132, 72, 128, 136, 8, 8, 6, 3, 38, 6, 80, 92]),
    ("sm_80", 128): _fa2("32x64", 941, 136, 68,
                         [256, 80, 16, 68, 68, 136, 64, 72, 8, 8, 6, 3, 22, 6, 12, 116]),
    ("sm_90", 64): _fa2("32x128", 1176, 208, 130,
                        [256, 72, 16, 132, 132, 72, 128, 136, 8, 8, 6, 3, 38, 6, 74, 89]),
    ("sm_90", 128): _fa2("32x64", 939, 160, 77,
                         [256, 80, 16, 68, 68, 136, 64, 72, 8, 8, 6, 3, 22, 6, 12, 114]),
}

# FlashAttention-2's backward counted the same way: flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<
# Flash_bwd_kernel_traits<64, 128, 128, 8, 4, 4, 4> (D = 64) or <128, 64, 128, 8, 2, 4, 2> (D = 128), false,
# false, half_t>, flags false for dropout, causal, local and alibi, true for even_MN and even_K, false for
# softcap> (flash_bwd_launch_template.h's run_mha_bwd_hdim64/128 where a block may have 144 KiB of shared
# memory, as on sm_80 and sm_90; L = S = 1024): the tile loop is its loop over query blocks, holding the five
# products (320 HMMA: 8 warps of a 128 x 128 or 64 x 128 tile) and dQ's atomic adds. Built 2026-11-30 from its
# flash_bwd_hdim{64,128}_fp16_sm80.cu with the forward's flags above, in 243 s and 270 s; figures in
# benchmarks/results/sass-2026-11-30-backward.md. Keyed by (arch, head dim).
FA2_BWD_ANCHOR: dict = {
    ("sm_80", 64): {"instrs": 1127, "hmma": 320, "per_hmma": 3.52, "stack": 96, "ldl_stl": 48},
    ("sm_80", 128): {"instrs": 891, "hmma": 320, "per_hmma": 2.78, "stack": 64, "ldl_stl": 33},
    ("sm_90", 64): {"instrs": 1094, "hmma": 320, "per_hmma": 3.42, "stack": 64, "ldl_stl": 32},
    ("sm_90", 128): {"instrs": 875, "hmma": 320, "per_hmma": 2.73, "stack": 8, "ldl_stl": 2},
}
# attnx's tensor-core backward (its plain instantiations: BWD_BUDGETED) within this factor of FA2's backward
# per HMMA on the steady path, both passes (measured 1.13-1.18 on 2026-11-30), and, as the forward's, no jump
# table, global load or 64-bit multiply anywhere in the tile loop (lse and delta come by cp.async from the
# workspace, the next tile's rows from pointers advanced by a constant).
MAX_BWD_XFA2 = {"keys": 1.3, "queries": 1.3}
BWD_BUDGETED = re.compile(r"^bwd (keys|queries) (fp16|bf16) bucket(64|128) plain$")

# ------------------------------------------------------------------------------------------------------------
# Instruction classes.

CLASSES = ["HMMA", "LDSM", "LDGSTS", "MUFU.EX2", "MUFU other", "FFMA", "FMUL", "FADD", "FMNMX", "FSEL/FSETP",
           "SHFL", "BAR/sync", "branch", "INT64", "LDG", "STG", "LDS/STS", "LDL/STL", "other"]
_FLOAT = {"FFMA", "FMUL", "FADD", "FMNMX"}
_BARRIER = {"BAR", "DEPBAR", "LDGDEPBAR", "MEMBAR", "ERRBAR", "WARPSYNC", "BSSY", "BSYNC", "NANOSLEEP",
            "ARRIVES", "SYNCS"}
_BRANCH = {"BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BREAK", "BPT", "KILL"}
# Jumps: control goes to the operand's target (BRA, JMP) or to the jump table's (BRX, JMX).
_JUMPS = {"BRA", "JMP", "BRX", "JMX"}
# Control does not go on to the next instruction when these are not predicated.
_ENDS = {"EXIT", "RET", "KILL", "BPT"} | _JUMPS


def is_imul64(opcode: str) -> bool:
    """A 64-bit (or high-half) integer multiply: IMAD.WIDE(.U32), IMAD.HI(.U32), IMUL.WIDE, their uniform
    forms."""
    base, *mods = opcode.split(".")
    return base in ("IMAD", "IMUL", "UIMAD", "UIMUL") and ("WIDE" in mods or "HI" in mods)


_CARRY_OUT = re.compile(r"^[^,]+,\s*U?P[0-6]\s*,")  # "R4, P0, ...": a predicate written second is a carry


def is_int64(opcode: str, operands: str = "") -> bool:
    """64-bit integer arithmetic: the multiplies of is_imul64; both halves of 64-bit adds and address
    arithmetic (IADD3 or LEA writing a carry, and their .X carry-in forms IADD3.X, LEA.HI.X, IMAD.X); 64-bit
    shifts (SHF .U64/.S64); the upper-word compares of 64-bit comparisons (ISETP .EX)."""
    base, *mods = opcode.split(".")
    if is_imul64(opcode):
        return True
    if base in ("IADD3", "UIADD3", "LEA", "ULEA", "IMAD", "UIMAD") and (
            "X" in mods or _CARRY_OUT.match(operands)):
        return True
    if base in ("SHF", "USHF") and ("U64" in mods or "S64" in mods):
        return True
    return base in ("ISETP", "UISETP") and "EX" in mods


def classify(opcode: str, operands: str = "") -> str:
    """The class (CLASSES) of an instruction, from its opcode with modifiers ("MUFU.EX2", "IMAD.WIDE.U32")
    and its operands (for the carry of a 64-bit add)."""
    base, _, mods = opcode.partition(".")
    if base.endswith("32I") and base[:-3] in _FLOAT:  # FFMA32I, FMUL32I, FADD32I: immediate forms
        base = base[:-3]
    if base in ("HMMA", "LDSM", "LDGSTS", "SHFL", "LDG", "STG") or base in _FLOAT:
        return base
    if base == "MUFU":
        return "MUFU.EX2" if mods.split(".")[0] == "EX2" else "MUFU other"
    if base in ("FSEL", "FSETP", "FSET"):
        return "FSEL/FSETP"
    if base in _BARRIER:
        return "BAR/sync"
    if base in _BRANCH:
        return "branch"
    if base in ("LDS", "STS"):
        return "LDS/STS"
    if base in ("LDL", "STL"):
        return "LDL/STL"
    if is_int64(opcode, operands):
        return "INT64"
    return "other"


# ------------------------------------------------------------------------------------------------------------
# Parsing nvdisasm (and cuobjdump -sass) output.


@dataclasses.dataclass
class Instr:
    addr: int
    pred: str  # "" when unpredicated ("@PT" counts as unpredicated)
    opcode: str  # with modifiers: "HMMA.16816.F32", "BRA.DIV"
    operands: str
    source: tuple | None = None  # (file, line) from nvdisasm -g
    targets: list = dataclasses.field(default_factory=list)  # labels or addresses a jump may go to
    base: str = ""  # the opcode without modifiers

    def __post_init__(self):
        self.base = self.opcode.split(".")[0]


@dataclasses.dataclass
class Function:
    name: str
    instrs: list
    labels: dict  # label -> address


_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:(@!?U?P(?:T|\d+))\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)"
                    r"(?:\s+([^;]*?))?\s*;")
_LABEL = re.compile(r"^([.$\w]+):\s*$")
_TYPE = re.compile(r"^\s*\.type\s+([^,\s]+)\s*,\s*@function")
_CUOBJDUMP_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_SOURCE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')
_TARGET_LABEL = re.compile(r"`\(([^)]+)\)")
_TARGET_ADDR = re.compile(r"(?<![\w.-])0x([0-9a-f]+)\b")
_BRANCH_TARGETS = re.compile(r'BRANCH_TARGETS ([^"*]+)')


def parse_sass(text: str) -> dict:
    """nvdisasm (or cuobjdump -sass) output -> {function name: Function}. Subroutines in a kernel's section
    (the $__internal_* slow paths) are functions of their own."""
    functions, current, pending, source = {}, None, set(), None
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m:
            if current is None:
                continue
            addr, pred, opcode, operands = int(m.group(1), 16), m.group(2) or "", m.group(3), m.group(4) or ""
            if pred == "@PT":
                pred = ""
            instr = Instr(addr, pred, opcode, operands.strip(), source)
            if instr.base in _JUMPS or instr.base == "CALL":
                table = _BRANCH_TARGETS.search(line)
                if table:
                    instr.targets = [t.strip() for t in table.group(1).split(",") if t.strip()]
                else:
                    label = _TARGET_LABEL.search(operands)
                    address = _TARGET_ADDR.search(operands) if instr.base in ("BRA", "JMP", "CALL") else None
                    instr.targets = ([label.group(1)] if label else [int(address.group(1), 16)] if address
                                     else [])
            current.instrs.append(instr)
            continue
        m = _SOURCE.match(line)
        if m:
            source = (m.group(1), int(m.group(2)))
            continue
        m = _TYPE.match(line)
        if m:
            pending.add(m.group(1))
            continue
        m = _CUOBJDUMP_FUNCTION.match(line)
        if m:
            current = functions[m.group(1)] = Function(m.group(1), [], {})
            source = None
            continue
        m = _LABEL.match(line)
        if m:
            name = m.group(1)
            if name in pending:
                pending.discard(name)
                current = functions[name] = Function(name, [], {})
                source = None
            elif current is not None and not name.startswith(".text."):
                current.instrs.append(name)  # resolved to the next instruction's address below
    for f in functions.values():  # labels -> the address of the instruction that follows them
        instrs, labels, waiting = [], {}, []
        for item in f.instrs:
            if isinstance(item, str):
                waiting.append(item)
            else:
                labels.update((name, item.addr) for name in waiting)
                waiting = []
                instrs.append(item)
        f.instrs, f.labels = instrs, labels
    return functions


# ------------------------------------------------------------------------------------------------------------
# Control-flow graph, dominators, natural loops.


@dataclasses.dataclass
class Block:
    index: int
    instrs: list
    succs: list = dataclasses.field(default_factory=list)  # (block index, "fall" | "taken")
    preds: list = dataclasses.field(default_factory=list)
    classes: Counter | None = None

    def count(self, cls: str) -> int:
        if self.classes is None:
            self.classes = Counter(classify(i.opcode, i.operands) for i in self.instrs)
        return self.classes[cls]


@dataclasses.dataclass
class Cfg:
    blocks: list
    unresolved: list  # jumps whose targets are unknown (a BRX without its table)
    calls: set = dataclasses.field(default_factory=set)  # addresses of calls to subroutines (slow paths)
    rpo: list = dataclasses.field(default_factory=list)  # reachable blocks in reverse postorder
    idom: dict = dataclasses.field(default_factory=dict)

    def dominates(self, a: int, b: int) -> bool:
        while b != a:
            parent = self.idom.get(b)
            if parent is None or parent == b:
                return False
            b = parent
        return True


def build_cfg(function: Function) -> Cfg:
    instrs = function.instrs
    if not instrs:
        return Cfg([], [])
    addr_index = {ins.addr: k for k, ins in enumerate(instrs)}

    def resolve(target):
        addr = function.labels.get(target) if isinstance(target, str) else target
        return addr_index.get(addr)

    def jumps(ins):  # a CALL into this function is a jump (sm_80 leaves loops so: CALL.REL.NOINC)
        return ins.base in _JUMPS or (ins.base == "CALL" and bool(ins.targets)
                                      and all(resolve(t) is not None for t in ins.targets))

    leaders, unresolved = {0}, []
    for k, ins in enumerate(instrs):
        if jumps(ins):
            for t in ins.targets:
                if resolve(t) is not None:
                    leaders.add(resolve(t))
            if not ins.targets or any(resolve(t) is None for t in ins.targets):
                unresolved.append(ins)
        if (ins.base in _ENDS or jumps(ins)) and k + 1 < len(instrs):
            leaders.add(k + 1)
    starts = sorted(leaders)
    blocks, block_of = [], {}
    for n, s in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(instrs)
        blocks.append(Block(n, instrs[s:end]))
        block_of[s] = n
    for b in blocks:
        last = b.instrs[-1]
        nxt = b.index + 1 if b.index + 1 < len(blocks) else None
        if jumps(last):
            for t in last.targets:
                k = resolve(t)
                if k is not None:
                    b.succs.append((block_of[k], "taken"))
        if (not (last.base in _ENDS or jumps(last)) or last.pred) and nxt is not None:
            b.succs.append((nxt, "fall"))
        for s, _ in b.succs:
            blocks[s].preds.append(b.index)
    cfg = Cfg(blocks, unresolved, {i.addr for i in instrs if i.base == "CALL" and not jumps(i)})
    _dominators(cfg)
    return cfg


def _dominators(cfg: Cfg) -> None:
    """Reverse postorder from the entry and immediate dominators (Cooper, Harvey and Kennedy's iteration)."""
    order, seen, stack = [], {0}, [(0, iter(cfg.blocks[0].succs))]
    while stack:  # iterative DFS: postorder
        node, it = stack[-1]
        for s, _ in it:
            if s not in seen:
                seen.add(s)
                stack.append((s, iter(cfg.blocks[s].succs)))
                break
        else:
            order.append(node)
            stack.pop()
    cfg.rpo = order[::-1]
    number = {b: k for k, b in enumerate(cfg.rpo)}
    idom = {0: 0}

    def intersect(a, b):
        while a != b:
            while number[a] > number[b]:
                a = idom[a]
            while number[b] > number[a]:
                b = idom[b]
        return a

    changed = True
    while changed:
        changed = False
        for b in cfg.rpo[1:]:
            done = [p for p in cfg.blocks[b].preds if p in idom]
            if not done:
                continue
            new = done[0]
            for p in done[1:]:
                new = intersect(p, new)
            if idom.get(b) != new:
                idom[b] = new
                changed = True
    cfg.idom = idom


@dataclasses.dataclass
class Loop:
    header: int
    body: set
    latches: list
    parent: Loop | None = None
    children: list = dataclasses.field(default_factory=list)


def find_loops(cfg: Cfg) -> list:
    """Natural loops (one per header: the union over its back edges), each with its parent (the smallest loop
    whose body holds it) and children; sorted by header."""
    reachable = set(cfg.idom)
    latches: dict = {}
    for b in reachable:
        for s, _ in cfg.blocks[b].succs:
            if cfg.dominates(s, b):
                latches.setdefault(s, []).append(b)
    loops = []
    for header, tails in sorted(latches.items()):
        body, work = {header}, list(tails)
        while work:
            n = work.pop()
            if n not in body:
                body.add(n)
                work.extend(p for p in cfg.blocks[n].preds if p in reachable)
        loops.append(Loop(header, body, sorted(tails)))
    for loop in loops:
        holders = [o for o in loops if o is not loop and loop.header in o.body and loop.body <= o.body]
        if holders:
            loop.parent = min(holders, key=lambda o: len(o.body))
            loop.parent.children.append(loop)
    return loops


# ------------------------------------------------------------------------------------------------------------
# Paths through one iteration of a loop.


@dataclasses.dataclass
class Path:
    kind: str
    blocks: list
    instrs: int
    classes: dict
    inner_entries: int
    calls: int
    softcap_branches: int

    def per_hmma(self):
        hmma = self.classes.get("HMMA", 0)
        return round(self.instrs / hmma, 2) if hmma else None


# Where the soft-cap test reads source lines: None, the working tree; a git revision (--sources), that
# revision's files for those inside this repository (a binary built before the tree changed).
SOURCE_REV = None
_SOURCES: dict = {}  # (SOURCE_REV, path) -> lines


def source_lines(path: str) -> list:
    """The lines of a source file the line info names, from the working tree or SOURCE_REV."""
    key = (SOURCE_REV, path)
    if key not in _SOURCES:
        text = ""
        rel = os.path.relpath(path, ROOT)
        if SOURCE_REV and not rel.startswith(".."):
            text = subprocess.run(["git", "-C", ROOT, "show", f"{SOURCE_REV}:{rel}"], capture_output=True,
                                  text=True).stdout
        else:
            # The run-time compiler's images name the embedded sources by their paths under csrc/
            # ("cuda/common.cuh"), which nvdisasm prefixes with its working directory: the file under csrc/
            # whose path is the longest such suffix.
            if not os.path.exists(path):
                parts = path.split(os.sep)
                under = [os.path.join(ROOT, "csrc", *parts[i:]) for i in range(1, len(parts))]
                path = next((c for c in under if os.path.isfile(c)), path)
            try:
                with open(path, errors="replace") as f:
                    text = f.read()
            except OSError:
                pass
        _SOURCES[key] = text.splitlines()
    return _SOURCES[key]


def _source_line(source) -> str:
    if not source:
        return ""
    lines = source_lines(source[0])
    return lines[source[1] - 1] if 0 < source[1] <= len(lines) else ""


def softcap_branches(instrs) -> int:
    """Conditional branches whose source line is a soft-cap test (SOFTCAP_SOURCE)."""
    return sum(1 for i in instrs
               if i.base == "BRA" and i.pred and SOFTCAP_SOURCE.search(_source_line(i.source)))


def _dag(cfg: Cfg, loop: Loop, loops: list):
    """The loop body with every back edge (and any retreating edge) removed: {block: [(succ, kind, entries)]}
    where entries is 1 when the edge enters an inner loop from outside it; and the blocks in topological
    order."""
    rank = {b: k for k, b in enumerate(cfg.rpo)}
    inner = {o.header: o for o in loops if o is not loop and o.body < loop.body}
    edges = {}
    for b in loop.body:
        edges[b] = [(s, kind, int(s in inner and b not in inner[s].body))
                    for s, kind in cfg.blocks[b].succs
                    if s in loop.body and s != loop.header and rank[s] > rank[b]]
    return edges, sorted(loop.body, key=rank.get)


def _make_path(kind, cfg, blocks, entries) -> Path:
    instrs = [i for b in blocks for i in cfg.blocks[b].instrs]
    classes = Counter(classify(i.opcode, i.operands) for i in instrs)
    return Path(kind, blocks, len(instrs), {c: classes[c] for c in CLASSES if classes[c]}, entries,
                sum(i.addr in cfg.calls for i in instrs), softcap_branches(instrs))


def _operands(instr: Instr) -> list:
    return [o.strip() for o in instr.operands.split(",")]


def _register(operand: str):
    """The register an operand names ("R12", "-R3.reuse", "!P2", "UR4"), or None (RZ, PT, c[...], ...)."""
    m = re.fullmatch(r"[-!|~]*(U?R\d+|U?P[0-6])(\.\w+)*\|?", operand)
    return m.group(1) if m else None


def _writes(instr: Instr) -> set:
    """The registers an instruction writes: its first operand (with the registers after it for 64-bit and
    wider results: .64/.WIDE/CS2R a pair, .128, HMMA and LDSM four, over-counting the narrower forms) and a
    predicate second (ISETP P0, P1, ...; IADD3 R0, P0, ... a carry). Stores and branches write none."""
    if instr.base in _BRANCH or instr.base in ("STG", "STS", "STL", "ST", "RED", "LDGSTS", "BAR", "BSSY",
                                                "BSYNC", "DEPBAR", "LDGDEPBAR", "WARPSYNC"):
        return set()
    ops = _operands(instr)
    if ops[0] == "PR":  # R2P PR, R0, mask: every predicate
        return {f"P{k}" for k in range(7)}
    out = set()
    first = _register(ops[0]) if ops else None
    if first:
        width = 1
        mods = instr.opcode.split(".")[1:]
        if instr.base in ("HMMA", "LDSM") or "128" in mods:
            width = 4
        elif "64" in mods or "WIDE" in mods or instr.base == "CS2R":
            width = 2
        m = re.fullmatch(r"(U?R)(\d+)", first)
        out |= {f"{m.group(1)}{int(m.group(2)) + k}" for k in range(width)} if m else {first}
    if len(ops) > 1:
        second = _register(ops[1])
        if second and "P" in second:
            out.add(second)
    return out


def _branch_predicates(instr: Instr) -> set:
    """The predicate registers a branch's condition reads: its guard and a predicate operand (BRA !P3,
    ...)."""
    found = {instr.pred.lstrip("@!")} if instr.pred else set()
    for op in _operands(instr):
        reg = _register(op)
        if reg and "P" in reg:
            found.add(reg)
    return found


# Loads whose value may change between iterations (LDC/ULDC read the constant bank: kernel parameters).
_LOADS = {"LDG", "LDS", "LDL", "LD", "LDSM", "ATOM", "ATOMS", "ATOMG", "SHFL", "VOTE", "MATCH", "REDUX"}


class _Variance:
    """Whether a register's value changes from one iteration of a loop to the next: its last write before a
    point (in the block, then up the dominators inside the loop) reads a register that does, recursively;
    a register the body writes with no such dominating write is loop-carried (it does); one the body never
    writes does not (a kernel parameter, a value computed before the loop). Constants (c[...], immediates,
    special registers) do not."""

    DEPTH = 8  # past this many writes back, a value counts as changing

    def __init__(self, cfg: Cfg, loop: Loop):
        self.cfg, self.loop = cfg, loop
        self.written = set().union(*(_writes(i) for b in loop.body for i in cfg.blocks[b].instrs))
        self.memo: dict = {}

    def _definition(self, block: int, index: int, reg: str):
        b = block
        while b in self.loop.body:
            instrs = self.cfg.blocks[b].instrs
            for k in range(index - 1 if b == block else len(instrs) - 1, -1, -1):
                text = instrs[k].operands
                if (reg in text or text.startswith("PR")) and reg in _writes(instrs[k]):
                    return b, k
            if b == self.loop.header:
                return None
            b = self.cfg.idom.get(b)
        return None

    def varies(self, block: int, index: int, reg: str, depth: int = DEPTH) -> bool:
        key = (block, index, reg)
        if key not in self.memo:
            self.memo[key] = True  # a cycle through the dominators cannot happen; guard anyway
            found = self._definition(block, index, reg)
            if found is None:
                result = reg in self.written
            elif depth == 0:
                result = True
            else:
                b, k = found
                instr = self.cfg.blocks[b].instrs[k]
                ops = _operands(instr)
                second = _register(ops[1]) if len(ops) > 1 else None
                first_source = 2 if second and "P" in second else 1  # ISETP P0, P1, ...; IADD3 R0, P0, ...
                sources = {r for op in ops[first_source:] for r in [_register(op)] if r}
                if instr.pred:  # where the predicate is false the register keeps its value: read it too
                    sources |= {instr.pred.lstrip("@!"), reg}
                # a value loaded from memory (but the constant bank) may differ from tile to tile
                result = instr.base in _LOADS or any(self.varies(b, k, r, depth - 1) for r in sources)
            self.memo[key] = result
        return self.memo[key]

    def data_dependent(self, block: int) -> bool:
        """True when the block's closing branch tests a value that changes from tile to tile (a key index
        against the tile's size): a data-dependent branch. False: a feature switch (a mask kind, the
        soft-cap, the staging mode), the same for every tile."""
        instrs = self.cfg.blocks[block].instrs
        return any(self.varies(block, len(instrs) - 1, r) for r in _branch_predicates(instrs[-1]))


def _post_dominators(cfg: Cfg, loop: Loop, edges: dict, order: list) -> dict:
    """Immediate post-dominators in the loop's DAG; None stands for the iteration's end, where the back edges
    and the loop's exits go (an inner loop's back edge is left out)."""
    rank = {b: k for k, b in enumerate(order)}
    ipdom: dict = {}

    def intersect(a, b):
        while a != b:
            if a is None or b is None:
                return None
            if rank[a] < rank[b]:
                a = ipdom[a]
            else:
                b = ipdom[b]
        return a

    for b in reversed(order):
        succ = [s for s, _, _ in edges[b]]
        leaves = not succ or any(s == loop.header or s not in loop.body for s, _ in cfg.blocks[b].succs)
        new = None if leaves else succ[0]
        for s in succ[1:]:
            new = intersect(new, s)
        ipdom[b] = new
    return ipdom


def _skips(cfg: Cfg, loop: Loop, edges: dict, order: list) -> set:
    """The edges of data-dependent conditional branches (on a value that changes from tile to tile,
    _Variance) that jump over a block to where the two sides join (the branch's immediate post-dominator):
    the common tile, full and interior, does the work they skip (a copy's address where its key is in the
    tile, the test of a tile's keys against the rows' ranges); but a run's end (RUN_SOURCE)."""
    ipdom = _post_dominators(cfg, loop, edges, order)
    variance = _Variance(cfg, loop)
    out = set()
    for b, succ in edges.items():
        targets = {s for s, _, _ in succ}
        last = cfg.blocks[b].instrs[-1]
        if (len(targets) == 2 and ipdom[b] in targets and variance.data_dependent(b)
                and not RUN_SOURCE.search(_source_line(last.source))):
            out.add((b, ipdom[b]))
    return out


def loop_paths(cfg: Cfg, loop: Loop, loops: list) -> dict:
    """The steady, fall, min and max paths of one iteration (see the module docstring): {kind: Path}."""
    edges, order = _dag(cfg, loop, loops)
    latches = set(loop.latches)
    skips = _skips(cfg, loop, edges, order)
    # The blocks that load a bool mask's packed bits (PACKED_SOURCE), for the "bits" path.
    def packed_load(i):
        return i.base == "LDG" and PACKED_SOURCE.search(_source_line(i.source))

    packed = {b for b in loop.body if any(packed_load(i) for i in cfg.blocks[b].instrs)}

    def cost(b, kind, edge=None, entry=0):
        blk = cfg.blocks[b]
        n = len(blk.instrs)
        if kind in ("steady", "bits"):
            calls = sum(i.addr in cfg.calls for i in blk.instrs)
            steady = (-blk.count("HMMA"), -blk.count("LDGSTS"), entry, calls, int(edge in skips), n)
            # bits: first, no other global load (a mask element read: the bool mask alone, packed; a block may
            # hold the packed loads of both of a lane's rows)
            other = sum(i.base == "LDG" and not packed_load(i) for i in blk.instrs)
            return steady if kind == "steady" else (other, *steady)
        return (n if kind == "min" else -n,)

    def add(a, b):
        return tuple(x + y for x, y in zip(a, b, strict=True))

    paths = {}
    for kind in ("steady", "min", "max", "bits"):
        if kind == "bits" and not packed:
            continue
        # bits: a node is (block, whether the path has been through the packed load)
        through = (lambda b, f: f or b in packed) if kind == "bits" else (lambda b, f: True)
        start = (loop.header, through(loop.header, False))
        best = {start: (cost(loop.header, kind), None, 0)}
        for b in order:
            for f in (False, True):
                if (b, f) not in best:
                    continue
                for s, _, entry in edges[b]:
                    node = (s, through(s, f))
                    cand = add(best[(b, f)][0], cost(s, kind, (b, s), entry))
                    if node not in best or cand < best[node][0]:
                        best[node] = (cand, (b, f), best[(b, f)][2] + entry)
        ends = [(b, True) for b in latches if (b, True) in best]
        if not ends:
            continue
        end = min(ends, key=lambda n: best[n][0])
        blocks, n = [], end
        while n is not None:
            blocks.append(n[0])
            n = best[n][1]
        paths[kind] = _make_path(kind, cfg, blocks[::-1], best[end][2])
    # fall: the side not taken where it can still reach a latch
    reach = set(latches)
    for b in reversed(order):
        if any(s in reach for s, _, _ in edges[b]):
            reach.add(b)
    if loop.header in reach:
        blocks, b, entries = [loop.header], loop.header, 0
        while True:
            options = [(s, kind, e) for s, kind, e in edges[b] if s in reach]
            ends_here = b in latches
            fall = [o for o in options if o[1] == "fall"]
            back_is_fall = any(s == loop.header and kind == "fall" for s, kind in cfg.blocks[b].succs)
            if ends_here and (back_is_fall or not fall):
                break
            step = (fall or options)[0]
            entries += step[2]
            b = step[0]
            blocks.append(b)
        paths["fall"] = _make_path("fall", cfg, blocks, entries)
    return paths


def body_counts(cfg: Cfg, loop: Loop) -> dict:
    """What the budgets look for anywhere in the loop's body: BRX, LDG, 64-bit multiplies, soft-cap
    branches, and whether a jump's targets are unknown."""
    instrs = [i for b in loop.body for i in cfg.blocks[b].instrs]
    return {"brx": sum(i.base == "BRX" for i in instrs), "ldg": sum(i.base == "LDG" for i in instrs),
            "imul64": sum(is_imul64(i.opcode) for i in instrs), "softcap_branches": softcap_branches(instrs),
            "unresolved_jumps": sum(i in cfg.unresolved for i in instrs), "blocks": len(loop.body),
            "instrs": len(instrs), "hmma": sum(i.base == "HMMA" for i in instrs)}


def tile_loop(function: Function) -> dict | None:
    """The kernel's key-tile loop and its paths (module docstring), or None when no loop holds HMMA."""
    cfg = build_cfg(function)
    loops = find_loops(cfg)
    hmma = {id(o): sum(cfg.blocks[b].count("HMMA") for b in o.body) for o in loops}
    copies = {id(o): sum(cfg.blocks[b].count("LDGSTS") for b in o.body) for o in loops}

    def outermost(o, held):
        p = o.parent
        while p is not None:
            if held(p):
                return False
            p = p.parent
        return True

    # The loops that issue the next tile's copies (LDGSTS) and its HMMA, innermost first (a loop over work
    # items around the tile loop, FA2's backward's over key blocks, also holds both); else the outermost
    # loops that hold HMMA.
    tiles = [o for o in loops if hmma[id(o)] and copies[id(o)]]
    candidates = [o for o in tiles if not any(i is not o and i.body < o.body for i in tiles)]
    if not candidates:
        candidates = [o for o in loops if hmma[id(o)] and outermost(o, lambda p: hmma[id(p)])]
    if not candidates:
        return None
    found = []
    for o in candidates:
        paths = loop_paths(cfg, o, loops)
        if "steady" in paths:
            s = paths["steady"]
            found.append(((-s.classes.get("HMMA", 0), -s.classes.get("LDGSTS", 0), s.inner_entries, s.calls,
                           s.instrs), o, paths))
    if not found:
        return None
    _, loop, paths = min(found, key=lambda x: x[0])
    inner = [o for o in loops if o is not loop and o.body < loop.body]
    return {"header_addr": cfg.blocks[loop.header].instrs[0].addr, "candidates": len(candidates),
            "inner_loops": len(inner), "body": body_counts(cfg, loop), "paths": paths,
            "cfg_blocks": len(cfg.blocks)}


# ------------------------------------------------------------------------------------------------------------
# Kernel names.

_DTYPE_NAMES = {"__half": "fp16", "half": "fp16", "cutlass::half_t": "fp16", "__nv_bfloat16": "bf16",
                "cutlass::bfloat16_t": "bf16", "float": "fp32", "double": "fp64"}
# attnx's kernels: base name -> (short name, names of the template arguments after the dtype and bucket: a
# number is written after its name, a flag as its name when true; a pair names (true, false)).
_ATTNX = {"attention_forward_mma": ("mma", [{"0": "plain", "1": "bits", "2": "general", "3": "capped"}]),
          "attention_forward_simt": ("simt", ["rows"]),
          "attention_backward_mma_queries": ("bwd queries", [{"0": "plain", "1": "bits", "2": "general"}]),
          "attention_backward_mma_keys": ("bwd keys", [{"0": "plain", "1": "bits", "2": "general"}])}


def mma_shape(code: int) -> tuple:
    """(row groups, warps, keys, stages) of a forward tile shape's code (attention_plan.h, mma_shape_code)."""
    return code // 1000, code // 100 % 10, code // 10 % 10 * 64, code % 10


def mma_default_shape(element: int, bucket: int, plain: bool) -> int:
    """attention_plan.h's mma_default_shape: 4 warps, 64 keys, 2 stages, two row groups for the plain 16-bit
    kernels up to bucket 64."""
    return (2 if plain and element == 2 and bucket <= 64 else 1) * 1000 + 412


def _named(name, value: str) -> str:
    if isinstance(name, dict):  # an enumeration's values by name
        return name.get(value, f"variant={value}")
    if isinstance(name, tuple):
        return name[0] if value == "true" else name[1] if value == "false" else f"{name[0]}={value}"
    return f"{name}{value}"


# FA2's flash_fwd_kernel<Kernel_traits, Is_dropout, Is_causal, Is_local, Has_alibi, Is_even_MN, Is_even_K,
# Is_softcap, Return_softmax> (flash_fwd_launch_template.h at 0251105a): the flags that are true are named.
_FA2_FLAGS = ["dropout", "causal", "local", "alibi", "even_MN", "even_K", "softcap", "return_softmax"]


def demangle(names) -> dict:
    """{mangled: demangled} through c++filt when there is one (the mangled name otherwise)."""
    names = list(names)
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out, strict=True)) if len(out) == len(names) else {n: n for n in names}


def _template_args(text: str, start: int) -> tuple[list, int]:
    """The top-level template arguments of the '<' at text[start]; and the index after the matching '>'."""
    args, depth, cur = [], 0, ""
    for k in range(start, len(text)):
        ch = text[k]
        if ch == "<":
            depth += 1
            if depth == 1:
                continue
        elif ch == ">":
            depth -= 1
            if depth == 0:
                args.append(cur.strip())
                return args, k + 1
        elif ch == "," and depth == 1:
            args.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return args, len(text)


def short_name(demangled: str) -> str:
    """A kernel's name for the table: "mma fp16 bucket64" (attnx's attention_forward_mma<__half, 64>; with a
    third argument kVariant: "mma fp16 bucket64 plain" / "... bits" / "... general"), "simt fp32 bucket128
    rows4", "fa2 fp16 hdim64 128x128 4w even_MN even_K" (FA2's flash_fwd_kernel: head dim, tile, warps, the
    flags that are true); any other kernel: its unqualified name and template arguments."""
    m = re.search(r"(\w+)<", demangled)
    if not m:
        return re.sub(r"\(.*", "", demangled).split("::")[-1]
    base = m.group(1)
    args, _ = _template_args(demangled, m.end() - 1)
    strip = [re.sub(r"\b\w+::", "", a) for a in args]
    if base in _ATTNX and len(args) >= 2:
        short, extra = _ATTNX[base]
        words = [short, _DTYPE_NAMES.get(args[0], strip[0]), f"bucket{args[1]}"]
        rest = strip[2:]
        if base == "attention_forward_mma" and len(rest) == 2 and rest[1].isdigit():
            # kShape: written as attnx::_cuda_mma_shape names it ("32x128 w4 s3") where not the default
            element = 4 if words[1] == "fp32" else 2
            code = int(rest[1])
            if code == mma_default_shape(element, int(args[1]), rest[0] == "0"):
                rest = rest[:1]
            else:
                groups, warps, keys, stages = mma_shape(code)
                rest = [rest[0], f"{16 * groups}x{keys} w{warps} s{stages}"]
        words += [_named(n, v) for n, v in zip(extra, rest, strict=False)] + rest[len(extra):]
        return " ".join(words)
    if base == "flash_fwd_kernel" and args:
        traits, _ = _template_args(args[0], args[0].find("<")) if "<" in args[0] else ([], 0)
        words = ["fa2"]
        if len(traits) >= 7:
            words += [_DTYPE_NAMES.get(traits[6], traits[6]), f"hdim{traits[0]}", f"{traits[1]}x{traits[2]}",
                      f"{traits[3]}w"]
        words += [n for n, v in zip(_FA2_FLAGS, args[1:], strict=False) if v == "true"]
        return " ".join(words)
    return f"{base}<{', '.join(strip)}>"


def threads_from_name(demangled: str) -> int | None:
    """Threads per block where a name gives them: FA2's Flash_fwd_kernel_traits<D, M, N, warps, ...>."""
    m = re.search(r"Flash_fwd_kernel_traits<\s*\d+,\s*\d+,\s*\d+,\s*(\d+)", demangled)
    return 32 * int(m.group(1)) if m else None


def dynamic_smem(short: str, demangled: str) -> int | None:
    """The dynamic shared memory a kernel is launched with, where known: attnx's mma kernel, per
    plan_attention_mma (csrc/cuda/attention_plan.h: kMmaStages = 2 stages of a K and a V tile of
    kMmaTileKeys = 64 rows of mma_tile_ld = bucket + one 16-byte unit, and the block's Q rows where the kernel
    stages them, mma_q_shared: 128 for the plain 16-bit kernels up to bucket 64, whose warps have two row
    groups, 64 for float32 at bucket 128), and the general instantiation's mask tile (64 rows of kMmaBiasLd =
    72 floats); FA2's, per its
    Kernel_traits::kSmemSize (Q tile + 2 x (K or V tile), in 16-bit elements, when Q and K do not share).
    tests/test_sass.py checks the attnx formula against attention_plan.h."""
    m = re.match(r"bwd (?:keys|queries) (fp16|bf16|fp32) bucket(\d+)", short)
    if m:  # mma_backward_smem_bytes without attn_mask's gradient: own tiles, two stages, lse rows, votes,
        # a block map's or bool attn_mask's bits (two words a row and stage), a float mask's classes (16 B)
        element, bucket = 4 if m.group(1) == "fp32" else 2, int(m.group(2))
        tile = 32 if bucket > 64 or (element == 4 and bucket > 32) else 64  # mma_backward_tile
        return (2 * 64 + 4 * tile) * (bucket + 16 // element) * element + 8 * tile * 4 + 32
    m = re.match(r"mma (fp16|bf16|fp32) bucket(\d+)(?: (plain|bits|general|capped))?"
                 r"(?: (\d+)x(\d+) w(\d) s(\d))?$",
                 short)
    if m:
        element = 4 if m.group(1) == "fp32" else 2
        bucket = int(m.group(2))
        plain = m.group(3) == "plain"
        if m.group(4):  # a shape of the family
            groups, keys, warps, stages = (int(m.group(4)) // 16, int(m.group(5)), int(m.group(6)),
                                           int(m.group(7)))
        else:
            groups, warps, keys, stages = mma_shape(mma_default_shape(element, bucket, plain))
        q_rows = 16 * groups * warps if groups > 1 or (element == 4 and bucket > 64) else 0  # mma_q_shared
        mask_tile = 64 * (64 + 8) * 4 if m.group(3) in ("general", "capped") else 0  # kMmaBiasLd floats a row
        return (stages * 2 * keys + q_rows) * (bucket + 16 // element) * element + mask_tile
    m = re.search(r"Flash_fwd_kernel_traits<\s*(\d+),\s*(\d+),\s*(\d+),\s*\d+,\s*(\w+),\s*(\w+)", demangled)
    if m:
        d, bm, bn, share = int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(5) == "true"
        q, kv = bm * d * 2, 2 * bn * d * 2
        return max(q, kv) if share else q + kv
    return None


# ------------------------------------------------------------------------------------------------------------
# Occupancy.


def occupancy(arch: str, registers: int, threads: int | None, shared: int | None) -> dict:
    """Blocks and warps per SM (ARCH_LIMITS' rules) and what limits them; shared: static + dynamic bytes
    (None: unknown, left out)."""
    lim = ARCH_LIMITS.get(arch)
    if lim is None or not threads:
        return {"blocks": None, "warps": None, "limit": "unknown"}
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // lim["reg_unit"]) * lim["reg_unit"]
    by = {"warps": lim["max_warps"] // warps, "blocks": lim["max_blocks"]}
    by["registers"] = 0 if registers > lim["max_regs_per_thread"] else (
        lim["sub_partitions"] * ((lim["regs_per_sm"] // lim["sub_partitions"]) // per_warp) // warps)
    if shared is not None:
        per_block = -(-(shared + lim["smem_reserved"]) // lim["smem_unit"]) * lim["smem_unit"]
        by["shared"] = lim["smem_per_sm"] // per_block
    blocks = min(by.values())
    return {"blocks": blocks, "warps": blocks * warps,
            "limit": "+".join(k for k, v in by.items() if v == blocks)}


# ------------------------------------------------------------------------------------------------------------
# Cubins: extraction, ELF attributes, disassembly.

EIATTR_MAX_THREADS = 0x05  # __launch_bounds__'s maxThreadsPerBlock (.maxntid): 3 words x, y, z
EIATTR_REQNTID = 0x10  # __cluster_dims__-style required block size (.reqntid): 3 words


@dataclasses.dataclass
class Cubin:
    path: str
    arch: str
    symbols: dict  # function name -> symbol index (nvdisasm -fun)
    threads: dict  # function name -> threads per block from .maxntid / .reqntid


def read_cubin(path: str) -> Cubin:
    """A cubin's arch (ELF e_flags), function symbols and their threads per block (.nv.info.<function>)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path}: not a 64-bit ELF cubin")
    flags = struct.unpack_from("<I", data, 0x30)[0]
    sm = (flags >> 8) & 0xFF if data[8] >= 8 else flags & 0xFF  # ELF ABI version 8 moved the SM field
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + k * shentsize) for k in range(shnum)]

    def string(table, offset):
        start = sections[table][4] + offset
        return data[start:data.index(b"\0", start)].decode(errors="replace")

    symbols, threads = {}, {}
    for sec in sections:
        if sec[1] == 2:  # SHT_SYMTAB
            for k in range(sec[5] // 24):
                name_off, info = struct.unpack_from("<IB", data, sec[4] + 24 * k)
                if info & 0xF == 2:  # STT_FUNC
                    symbols[string(sec[6], name_off)] = k
    for sec in sections:
        name = string(shstrndx, sec[0])
        if not name.startswith(".nv.info."):
            continue
        pos, end = sec[4], sec[4] + sec[5]
        while pos + 4 <= end:
            fmt, attr = data[pos], data[pos + 1]
            if fmt == 0x04:  # EIFMT_SVAL: a 16-bit size, then the payload
                size = struct.unpack_from("<H", data, pos + 2)[0]
                payload, pos = data[pos + 4:pos + 4 + size], pos + 4 + size
            else:
                payload, pos = data[pos + 2:pos + 4], pos + 4
            if attr in (EIATTR_MAX_THREADS, EIATTR_REQNTID) and len(payload) >= 12:
                x, y, z = struct.unpack_from("<III", payload)
                threads[name[len(".nv.info."):]] = x * max(y, 1) * max(z, 1)
    return Cubin(path, f"sm_{sm}", symbols, threads)


def find_nvdisasm(cuobjdump: str | None):
    """nvdisasm on PATH or in the toolkit (gpu_check.find_tool), else beside cuobjdump (triton's copies)."""
    found = gpu_check.find_tool("nvdisasm")
    if found:
        return found
    if cuobjdump:
        beside = os.path.join(os.path.dirname(cuobjdump), "nvdisasm")
        if os.path.exists(beside):
            return beside
    return None


def extract_cubins(path: str, cuobjdump: str, workdir: str, wanted: re.Pattern | None) -> list:
    """The cubins of a library or object (cuobjdump -xelf into workdir) whose names match wanted; a .cubin
    path is itself."""
    with open(path, "rb") as f:
        head = f.read(64)
    if path.endswith(".cubin") or (head[:4] == b"\x7fELF" and head[7] == 0x41):  # ELFOSABI_CUDA
        return [path]
    listing = subprocess.run([cuobjdump, "-lelf", path], capture_output=True, text=True, check=True).stdout
    names = re.findall(r"ELF file\s+\d+:\s+(\S+)", listing)
    out = []
    for name in names:
        if wanted and not wanted.search(name):
            continue
        subprocess.run([cuobjdump, "-xelf", name, os.path.abspath(path)], cwd=workdir, capture_output=True,
                       check=True)
        if os.path.exists(os.path.join(workdir, name)):
            out.append(os.path.join(workdir, name))
    return out


def stale_sources(function: Function, built: float) -> list:
    """The source files of the function's line info that changed after the binary was built (their lines
    may not be the ones compiled): none when SOURCE_REV names the revision built."""
    if SOURCE_REV:
        return []
    files = {i.source[0] for i in function.instrs if i.source}
    return sorted(f for f in files if os.path.exists(f) and os.path.getmtime(f) > built)


def analyse_cubin(cubin_path: str, tools: dict, kernel_filter, include, built: float) -> list:
    """One row per kernel of the cubin that `include(demangled, short)` accepts; built: the input's mtime."""
    cubin = read_cubin(cubin_path)
    names = demangle(cubin.symbols)
    chosen = {n: short_name(names[n]) for n in cubin.symbols
              if not n.startswith("$") and include(names[n], short_name(names[n]))
              and (kernel_filter is None or kernel_filter.search(short_name(names[n]))
                   or kernel_filter.search(names[n]) or kernel_filter.search(n))}
    if not chosen:
        return []
    indices = ",".join(str(cubin.symbols[n]) for n in chosen)
    sass = subprocess.run([tools["nvdisasm"], "-g", "-c", "-fun", indices, cubin_path], capture_output=True,
                          text=True, check=True).stdout
    functions = parse_sass(sass)
    usage_text = subprocess.run([tools["cuobjdump"], "--dump-resource-usage", cubin_path],
                                capture_output=True, text=True, check=True).stdout
    usage = gpu_check.parse_resource_usage(f"arch = {cubin.arch}\n{usage_text}")
    rows = []
    for name, short in sorted(chosen.items(), key=lambda x: x[1]):
        fn = functions.get(name)
        if fn is None:
            continue
        res = usage.get((cubin.arch, name), {"registers": 0, "stack": 0, "shared": 0, "local": 0})
        threads = cubin.threads.get(name) or threads_from_name(names[name])
        dyn = dynamic_smem(short, names[name])
        local_accesses = sum(i.base in ("LDL", "STL") for i in fn.instrs)
        occ = occupancy(cubin.arch, res["registers"], threads,
                        None if dyn is None else res["shared"] + dyn)
        loop = tile_loop(fn)
        rows.append({"arch": cubin.arch, "kernel": short, "mangled": name, "demangled": names[name],
                     "cubin": os.path.basename(cubin_path), "instructions": len(fn.instrs), **res,
                     "ldl_stl": local_accesses, "spills": local_accesses > 0 or res["local"] > 0,
                     "threads": threads, "dynamic_shared": dyn, "occupancy": occ, "loop": loop,
                     "stale_sources": stale_sources(fn, built)})
    return rows


# ------------------------------------------------------------------------------------------------------------
# Budgets and the anchor.


def anchor_for(row: dict):
    """FA2's figures for this kernel's arch and head dim (its bucket), when recorded: its forward's for the
    forward kernels, its backward's for the backward's passes."""
    m = re.match(r"(mma|bwd keys|bwd queries) (fp16|bf16) bucket(\d+)", row["kernel"])
    if not m:
        return None
    return (FA2_ANCHOR if m.group(1) == "mma" else FA2_BWD_ANCHOR).get((row["arch"], int(m.group(3))))


# The tile loop's body's budgets (body_counts' keys): their limits and names.
BODY_LIMITS = {"brx": (MAX_BRX, "BRX (jump tables)"), "ldg": (MAX_LDG, "LDG (global loads)"),
               "imul64": (MAX_IMUL64, "64-bit multiplies (IMAD.WIDE/IMAD.HI)"),
               "softcap_branches": (MAX_SOFTCAP_BRANCHES, "soft-cap branches")}


def body_problems(where: str, body: dict, keys) -> list:
    """The budget lines of BODY_LIMITS (those named by `keys`) that the loop's body exceeds."""
    return [f"{where}: {body[k]} {BODY_LIMITS[k][1]} in the tile loop > {BODY_LIMITS[k][0]}"
            for k in keys if body[k] > BODY_LIMITS[k][0]]


def check_row(row: dict) -> list:
    """The budget lines this kernel exceeds (empty when it meets them all)."""
    where = f"{row['arch']} {row['kernel']}"
    problems = []
    if row["ldl_stl"] > MAX_SPILL_ACCESSES or row["local"] > 0:
        problems.append(f"{where}: spills ({row['ldl_stl']} LDL/STL, local {row['local']} B)")
    if BITS_BUDGETED.match(row["kernel"]):
        paths = row["loop"]["paths"] if row["loop"] else {}
        if "bits" not in paths or "steady" not in paths:
            problems.append(f"{where}: no path reads a bool mask's packed bits")
        elif paths["bits"].instrs > MAX_BITS_RATIO * paths["steady"].instrs:
            problems.append(f"{where}: a PARTIAL bool tile takes {paths['bits'].instrs} instructions > "
                            f"{MAX_BITS_RATIO} x the steady path's {paths['steady'].instrs}")
    loop = row["loop"]
    m = BWD_BUDGETED.match(row["kernel"])
    if m:
        if loop is None or "steady" not in loop["paths"]:
            return problems + [f"{where}: no tile loop (no loop holds HMMA)"]
        per_hmma, anchor = loop["paths"]["steady"].per_hmma(), anchor_for(row)
        limit = MAX_BWD_XFA2[m.group(1)]
        if per_hmma is not None and anchor and per_hmma > limit * anchor["per_hmma"]:
            problems.append(f"{where}: {per_hmma} instructions per HMMA on the steady path > {limit} x "
                            f"FlashAttention-2's backward's {anchor['per_hmma']}")
        return problems + body_problems(where, loop["body"], ("brx", "ldg", "imul64"))
    if FAMILY.match(row["kernel"]):
        if loop is None or "steady" not in loop["paths"]:
            return problems + [f"{where}: no tile loop (no loop holds HMMA)"]
        return problems + body_problems(where, loop["body"], ("brx", "ldg", "imul64", "softcap_branches"))
    m = BUDGETED.match(row["kernel"])
    if not m:
        if NO_BRX.match(row["kernel"]) and loop is not None:
            problems += body_problems(where, loop["body"], ("brx",))
        if NO_SOFTCAP.match(row["kernel"]) and loop is not None:
            problems += body_problems(where, loop["body"], ("softcap_branches",))
        return problems
    if loop is None or "steady" not in loop["paths"]:
        return problems + [f"{where}: no tile loop (no loop holds HMMA)"]
    bucket = int(m.group(2))
    per_hmma = loop["paths"]["steady"].per_hmma()
    if per_hmma is not None and per_hmma > MAX_PER_HMMA[bucket]:
        problems.append(f"{where}: {per_hmma} instructions per HMMA on the steady path "
                        f"> {MAX_PER_HMMA[bucket]}")
    body = loop["body"]
    problems += body_problems(where, body, ("brx", "ldg", "imul64", "softcap_branches"))
    if body["unresolved_jumps"]:
        problems.append(f"{where}: {body['unresolved_jumps']} jumps with unknown targets in the tile loop")
    return problems


# ------------------------------------------------------------------------------------------------------------
# Output.

_CLASS_ABBREV = {"MUFU.EX2": "EX2", "MUFU other": "MUFU", "FSEL/FSETP": "FSEL", "BAR/sync": "BAR",
                 "branch": "BRA", "LDS/STS": "LDS", "LDL/STL": "LDL", "LDGSTS": "LDGSTS"}


def _fmt(x):
    return "-" if x is None else str(x)


def format_table(rows: list) -> str:
    """The report: per kernel and arch, resources, occupancy and the tile loop's paths; then the steady path
    by instruction class."""
    width = max([len(r["kernel"]) for r in rows] + [6])
    lines = ["The tile loop: static SASS instructions in one iteration of one warp, on each path",
             "(tools/sass.py says what each path takes). reg: registers a thread; stack: bytes a thread;",
             "LDL: local loads and stores (spills) in the kernel; smem: static + dynamic shared memory a",
             "block, bytes; blk/SM, warps: blocks and warps an SM holds (the limit in the notes); bits: a",
             "PARTIAL tile of a bool mask (its packed bits read); HMMA and /HMMA: on the steady path; xFA2:",
             "/HMMA over FlashAttention-2's (same arch and head dim).",
             ""]
    head = (f"{'arch':6} {'kernel':{width}} {'reg':>4} {'stack':>5} {'LDL':>4} {'smem':>6} {'blk/SM':>6} "
            f"{'warps':>5} {'steady':>6} {'fall':>5} {'min':>5} {'max':>5} {'bits':>5} {'HMMA':>4} "
            f"{'/HMMA':>6} {'xFA2':>5}  notes")
    lines += [head, "-" * len(head)]
    for r in rows:
        loop, occ = r["loop"], r["occupancy"]
        paths = loop["paths"] if loop else {}
        s = paths.get("steady")
        anchor = anchor_for(r)
        ratio = round(s.per_hmma() / anchor["per_hmma"], 2) if anchor and s and s.per_hmma() else None
        smem = r["shared"] + r["dynamic_shared"] if r["dynamic_shared"] is not None else None
        notes = [f"{occ['limit']}-bound"] if occ["blocks"] is not None else []
        if loop:
            body = loop["body"]
            notes += [f"{body[k]} {label}" for k, label in (("brx", "BRX"), ("ldg", "LDG"),
                                                            ("imul64", "IMAD.WIDE/HI"),
                                                            ("softcap_branches", "cap branches"))
                      if body[k]]
            if loop["inner_loops"]:
                notes.append(f"{loop['inner_loops']} inner loops")
            if loop["candidates"] > 1:
                notes.append(f"{loop['candidates']} HMMA loops")
            if s and s.calls:
                notes.append(f"{s.calls} calls")
        else:
            notes.append("no HMMA loop")

        counts = {k: _fmt(paths[k].instrs if k in paths else None)
                  for k in ("steady", "fall", "min", "max", "bits")}
        lines.append(
            f"{r['arch']:6} {r['kernel']:{width}} {r['registers']:>4} {r['stack']:>5} {r['ldl_stl']:>4} "
            f"{_fmt(smem):>6} {_fmt(occ['blocks']):>6} {_fmt(occ['warps']):>5} {counts['steady']:>6} "
            f"{counts['fall']:>5} {counts['min']:>5} {counts['max']:>5} {counts['bits']:>5} "
            f"{_fmt(s and s.classes.get('HMMA', 0)):>4} {_fmt(s and s.per_hmma()):>6} {_fmt(ratio):>5}  "
            + ", ".join(notes))
    steady = [(r, r["loop"]["paths"]["steady"]) for r in rows if r["loop"] and "steady" in r["loop"]["paths"]]
    if steady:
        cols = [c for c in CLASSES if any(p.classes.get(c) for _, p in steady)]
        lines += ["", "The steady path by instruction class (the budgets' path; INT64: both halves of 64-bit "
                      "integer arithmetic, IMAD.WIDE/HI included):", ""]
        head = f"{'arch':6} {'kernel':{width}} " + " ".join(f"{_CLASS_ABBREV.get(c, c):>6}" for c in cols)
        lines += [head, "-" * len(head)]
        for r, p in steady:
            lines.append(f"{r['arch']:6} {r['kernel']:{width}} "
                         + " ".join(f"{p.classes.get(c, 0):>6}" for c in cols))
    buckets = {(r["arch"], int(m.group(1))) for r in rows
               for m in [re.match(r"mma (?:fp16|bf16) bucket(\d+)", r["kernel"])] if m}
    bwd = {(r["arch"], int(m.group(1))) for r in rows
           for m in [re.match(r"bwd \w+ (?:fp16|bf16) bucket(\d+)", r["kernel"])] if m}
    bwd = sorted(bwd & set(FA2_BWD_ANCHOR))
    anchors = sorted(buckets & set(FA2_ANCHOR))
    if bwd:
        lines += ["", f"xFA2 of the backward's passes: FlashAttention-2's backward counted the same way "
                      f"({FA2_COMMIT}, nvcc {FA2_NVCC}):"]
        for arch, d in bwd:
            a = FA2_BWD_ANCHOR[(arch, d)]
            lines.append(f"  {arch} D={d}: {a['per_hmma']} per HMMA, {a['instrs']} instructions an iteration "
                         f"({a['hmma']} HMMA), 255 registers, {a['stack']} B stack, {a['ldl_stl']} LDL/STL")
    if anchors:
        lines += ["", f"xFA2's anchor: FlashAttention-2's forward counted the same way ({FA2_COMMIT}, "
                      f"nvcc {FA2_NVCC}):"]
        for arch, d in anchors:
            a = FA2_ANCHOR[(arch, d)]
            lines.append(f"  {arch} D={d}: {a['per_hmma']} per HMMA, {a['instrs']} instructions an iteration "
                         f"(a warp's {a['warp_tile']} rows x keys, {a['hmma']} HMMA), {a['registers']} "
                         f"registers, {a['stack']} B stack, {a['ldl_stl']} LDL/STL")
    return "\n".join(lines)


def row_json(r: dict) -> dict:
    out = {k: v for k, v in r.items() if k != "loop"}
    loop = r["loop"]
    if loop:
        out["loop"] = {k: v for k, v in loop.items() if k != "paths"}
        out["loop"]["paths"] = {k: {"instrs": p.instrs, "per_hmma": p.per_hmma(), "classes": p.classes,
                                    "inner_entries": p.inner_entries, "calls": p.calls,
                                    "softcap_branches": p.softcap_branches, "blocks": len(p.blocks)}
                                for k, p in loop["paths"].items()}
    else:
        out["loop"] = None
    anchor = anchor_for(r)
    steady = loop and loop["paths"].get("steady")
    out["fa2_per_hmma"] = anchor["per_hmma"] if anchor else None
    out["ratio_to_fa2"] = (round(steady.per_hmma() / anchor["per_hmma"], 3)
                           if anchor and steady and steady.per_hmma() else None)
    return out


# ------------------------------------------------------------------------------------------------------------
# Main.

# The kernels reported by default: the tensor-core forward and backward (and the SIMT forward with --simt).
_DEFAULT = re.compile(r"attention_(forward_mma|forward_simt|backward_mma_keys|backward_mma_queries)<")


def default_library() -> str | None:
    libs = sorted(glob.glob(os.path.join(ROOT, "python", "attnx", "_C_cuda*.so")))
    return libs[0] if libs else None


def analyse(paths: list, arch=None, kernel=None, simt=False, tools=None) -> list:
    """Rows for every selected kernel of every input (library, object or cubin), sorted by arch and name."""
    kernel_filter = re.compile(kernel) if kernel else None

    def include(demangled, short):
        if kernel_filter is not None:
            return True  # the filter decides
        m = _DEFAULT.search(demangled)
        return bool(m) and (m.group(1) != "forward_simt" or simt)

    rows = []
    with tempfile.TemporaryDirectory(prefix="attnx-sass-") as work:
        for n, path in enumerate(paths):
            sub = os.path.join(work, str(n))
            os.makedirs(sub)
            # attnx's library: only the attention kernels' cubins
            wanted = re.compile(r"attention_(backward_)?kernel(_mma)?\.") if kernel_filter is None else None
            for cubin in extract_cubins(path, tools["cuobjdump"], sub, wanted):
                if arch and read_cubin(cubin).arch != arch:
                    continue
                rows += analyse_cubin(cubin, tools, kernel_filter, include, os.path.getmtime(path))
    return sorted(rows, key=lambda r: (r["arch"], r["kernel"]))


# The forward's tile-shape family (attention_plan.h: kMmaShapes, mma_shape_valid): its plain instantiation in
# every shape but the defaults, which the prebuilt library does not carry; compiled here by the run-time
# compiler (attnx._C_nvrtc) from the same sources. fp16 stands for bf16 (the same instructions); float32
# has one row group a warp and 64-key tiles (mma_shape_valid).
FAMILY_SHAPES = [g * 1000 + w * 100 + k * 10 + s
                 for g in (1, 2) for w in (4, 8) for k in (1, 2) for s in (2, 3)]


def mma_shape_valid(element: int, bucket: int, code: int) -> bool:
    """attention_plan.h's mma_shape_valid for the family's codes: two row groups a warp, or 128-key tiles
    (with one), for the 16-bit types up to bucket 64 only. tests/test_sass.py checks it against the header."""
    groups, _, keys, _ = mma_shape(code)
    wide = groups == 2 or keys == 128
    return not wide or (element == 2 and bucket <= 64 and not (groups == 2 and keys == 128))


def family_kernels() -> list:
    """The name expressions of the family's shapes other than the defaults, fp16 and fp32 at buckets 32, 64
    and 128."""
    out = []
    for scalar, element in (("__half", 2), ("float", 4)):
        for bucket in (32, 64, 128):
            default = mma_default_shape(element, bucket, True)
            for code in FAMILY_SHAPES:
                if mma_shape_valid(element, bucket, code) and code != default:
                    out.append(f"attnx::cuda::attention_forward_mma<{scalar}, {bucket}, 0, {code}>")
    return out


def family_rows(archs, tools) -> list:
    """Rows of family_kernels() compiled by attnx._C_nvrtc for each arch (80, 90); [] without it."""
    sys.path.insert(0, os.path.join(ROOT, "python"))
    from attnx import _cuda_runtime

    if _cuda_runtime.library() is None or _cuda_runtime.nvrtc_library()[0] is None:
        return []
    rows = []
    saved = os.environ.get("ATTNX_CUDA_CACHE")
    with tempfile.TemporaryDirectory(prefix="attnx-family-") as work:
        os.environ["ATTNX_CUDA_CACHE"] = work  # a fresh cache: its entries are the images read here
        try:
            _cuda_runtime.configure(reconfigure=True)
            for arch in archs:
                for kernel in family_kernels():
                    key = _cuda_runtime.compile("attention_kernel_mma.cu", kernel, arch)[1]
                    cubin = os.path.join(work, f"{key}.image")
                    with open(os.path.join(work, f"{key}.kernel"), "rb") as f:
                        image = f.read().split(b"\n\n", 1)[1]
                    with open(cubin, "wb") as f:
                        f.write(image)
                    rows += [r for r in analyse([cubin], tools=tools) if r["kernel"].startswith("mma ")]
        finally:
            if saved is None:
                os.environ.pop("ATTNX_CUDA_CACHE", None)
            else:
                os.environ["ATTNX_CUDA_CACHE"] = saved
            _cuda_runtime.configure(reconfigure=True)
    return sorted(rows, key=lambda r: (r["arch"], r["kernel"]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*",
                   help="libraries, objects or cubins (default: python/attnx/_C_cuda*.so)")
    p.add_argument("--report", action="store_true", help="print the table, never fail on a budget")
    p.add_argument("--arch", help="only this arch, e.g. sm_90")
    p.add_argument("--kernel", help="a regular expression on the kernel's short name (e.g. 'mma fp16 "
                   "bucket64'), demangled or mangled name; any kernel of the inputs (default: attnx's "
                   "tensor-core forward kernels)")
    p.add_argument("--simt", action="store_true", help="list attnx's SIMT forward kernels too")
    p.add_argument("--json", help="write the table (and the budget verdict) to this file")
    p.add_argument("--sources", metavar="REV", help="read the source lines the soft-cap test looks at from "
                   "this git revision (the one the binary was built from) rather than the working tree")
    p.add_argument("--family", action="store_true", help="add the forward's tile-shape family (every shape "
                   "of its unmasked instantiation but the defaults), compiled for sm_80 and sm_90 by "
                   "attnx._C_nvrtc")
    return p.parse_args(argv)


def main(argv=None) -> int:
    global SOURCE_REV
    args = parse_args(argv)
    SOURCE_REV = args.sources
    inputs = args.inputs or [default_library()]
    if inputs == [None]:
        print("sass: no CUDA library in python/attnx (a CPU-only build?); nothing to check")
        return 0 if args.report else 2
    cuobjdump = gpu_check.find_tool("cuobjdump")
    tools = {"cuobjdump": cuobjdump, "nvdisasm": find_nvdisasm(cuobjdump)}
    missing = [k for k, v in tools.items() if not v]
    if missing:
        print(f"sass: {', '.join(missing)} not found (the CUDA toolkit's, or triton's beside torch)")
        return 0 if args.report else 2
    rows = analyse(inputs, args.arch, args.kernel, args.simt, tools)
    if args.family:
        archs = [int(args.arch[3:])] if args.arch else [80, 90]
        family = family_rows(archs, tools)
        if not family:
            print("sass: --family needs attnx._C_nvrtc and NVRTC beside torch")
            return 0 if args.report else 2
        rows = sorted(rows + family, key=lambda r: (r["arch"], r["kernel"]))
    if not rows:
        print("sass: no kernel matched")
        return 0 if args.report else 2
    print(format_table(rows))
    problems = [p for r in rows for p in check_row(r)]
    print()
    stale = sorted({os.path.relpath(f, ROOT) for r in rows for f in r["stale_sources"]})
    if stale:
        print(f"note: {', '.join(stale)} changed after the binary was built: the soft-cap branches, found by "
              "their source lines, may be miscounted (rebuild, or --sources REV)")
    if problems:
        print("over budget (report only):" if args.report else "FAIL: over budget:")
        print("\n".join(f"  {p}" for p in problems))
    else:
        print("every budget met")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"inputs": inputs, "budgets": {"max_per_hmma": MAX_PER_HMMA}, "problems": problems,
                       "kernels": [row_json(r) for r in rows]}, f, indent=1)
            f.write("\n")
    return 1 if problems and not args.report else 0


if __name__ == "__main__":
    sys.exit(main())
