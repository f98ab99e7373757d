"""``python -m attnx.info``: does attention run here, on which backends, and with which kernels.

Everything is read from this process: the kernels attnx's loaded libraries registered with torch's dispatcher,
the devices torch sees, and the kernel each call takes, as the libraries name it (attnx::_attention_kernel,
attnx::_cpu_capability): no rule is restated here. ``python -m attnx.info --ops`` adds every op's dispatch
keys.
"""

import argparse
import ctypes
import glob
import importlib.metadata
import importlib.util
import os
import platform
import re

import torch

import attnx
from attnx import _loader

# Dispatch keys a kernel of an attnx op can be registered for, in the order they are reported.
# CompositeExplicitAutograd: one kernel for every backend: built from other ops, serving the backends those
# ops have (mha), or an op without tensor arguments (_cpu_capability).
# CompositeImplicitAutograd: the routers of linear, attention and mha, which choose a kernel op by grad mode.
DISPATCH_KEYS = (
    "CPU", "CUDA", "MPS", "CompositeExplicitAutograd", "CompositeImplicitAutograd", "Meta", "Autograd",
)
BACKENDS = ("CPU", "CUDA", "MPS")

# The public ops and the kernel ops they run. linear, attention, mha and varlen_attention are routers
# (csrc/common/routes.cpp) that run the first with grad mode off and the second with it on; the backward ops
# are kernel ops themselves.
KERNEL_OPS = {
    "attnx::linear": ("attnx::_linear", "attnx::_linear_autograd"),
    "attnx::attention": ("attnx::_attention", "attnx::_attention_autograd"),
    "attnx::attention_backward": ("attnx::attention_backward",),
    "attnx::mha": ("attnx::_mha", "attnx::mha_forward"),
    "attnx::mha_backward": ("attnx::mha_backward",),
    "attnx::varlen_attention": ("attnx::_varlen_attention", "attnx::_varlen_attention_autograd"),
    "attnx::varlen_attention_backward": ("attnx::varlen_attention_backward",),
}

# What a composite (CompositeExplicitAutograd) kernel needs in order to run on a backend: the attnx ops it
# calls (csrc/common/mha.cpp) and, for a backward, the forward whose outputs it takes (attention_backward's
# composite, csrc/common/attention_math.cpp, calls torch's ops only). Without this, a composite would claim
# every backend, those attnx has no forward for included.
COMPOSITE_NEEDS = {
    "attnx::_mha": ("attnx::_linear", "attnx::_attention"),
    "attnx::mha_forward": ("attnx::_linear", "attnx::_attention"),
    "attnx::attention_backward": ("attnx::_attention",),
    "attnx::mha_backward": ("attnx::mha_forward", "attnx::attention_backward"),
}

# attnx::_cpu_capability's answers (ATEN_CPU_CAPABILITY's spelling) as the report names them.
ISA_NAMES = {"amx_bf16": "AVX-512 with AMX-BF16", "avx512_bf16": "AVX-512 with AVX512-BF16",
             "avx512": "AVX-512", "avx2": "AVX2", "default": "baseline",
             "emulated_bf16": "AVX512-BF16 emulated on the baseline ISA",
             "emulated_amx": "AMX-BF16 emulated on the baseline ISA"}

# The libraries attnx.integrations adapts, by import name, with the distribution that installs each.
INTEGRATIONS = (("transformers", "transformers"), ("timm", "timm"), ("open_clip", "open_clip_torch"))

CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def ops() -> list[str]:
    """Every op registered under the attnx namespace, e.g. ``attnx::linear``."""
    return sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("attnx::"))


def kernels(op: str) -> list[str]:
    """The dispatch keys that have a kernel for ``op``."""
    return [key for key in DISPATCH_KEYS if torch._C._dispatch_has_kernel_for_dispatch_key(op, key)]


def backend_kinds(op: str) -> dict[str, str]:
    """How kernel op ``op`` runs on each backend it runs on in this process: ``"kernel"`` (one registered for
    the backend) or ``"composite"`` (its CompositeExplicitAutograd kernel, where the ops it needs run)."""
    kinds = {}
    for backend in BACKENDS:
        if torch._C._dispatch_has_kernel_for_dispatch_key(op, backend):
            kinds[backend] = "kernel"
        elif torch._C._dispatch_has_kernel_for_dispatch_key(op, "CompositeExplicitAutograd") and all(
            backend in backend_kinds(needed) for needed in COMPOSITE_NEEDS.get(op, ())
        ):
            kinds[backend] = "composite"
    return kinds


def op_backends(op: str) -> dict[str, str]:
    """The backends public op ``op`` (a key of KERNEL_OPS) runs on in this process, grad mode on and off: each
    ``"kernel"``, or ``"composite"`` where one of its kernel ops is a composite there."""
    per_op = [backend_kinds(kernel_op) for kernel_op in KERNEL_OPS[op]]
    return {
        backend: "composite" if any(kinds[backend] == "composite" for kinds in per_op) else "kernel"
        for backend in BACKENDS if all(backend in kinds for kinds in per_op)
    }


def cpu_isa() -> str:
    """The ISA level attnx's CPU attention kernels (forward and backward) run at in this process: ``AVX-512
    with AMX-BF16`` (bfloat16 products on AMX tiles), ``AVX-512 with AVX512-BF16`` (on vdpbf16ps),
    ``AVX-512``, ``AVX2`` or ``baseline``, or an emulation that ATTNX_CPU_CAPABILITY=emulated_bf16 or
    emulated_amx asks for. The library's own answer (cpu_capability() in csrc/cpu/attention_kernel.h):
    torch's rule, ATEN_CPU_CAPABILITY included, then AMX-BF16 where the CPU has it and the OS grants the tile
    state, else AVX512-BF16 where the CPU has it (not on Intel cores, where it measured slower than the
    float32 products), ATTNX_CPU_CAPABILITY's choice, and baseline where the wider variants are not built."""
    return ISA_NAMES[torch.ops.attnx._cpu_capability()]


def attention_kernel(device, dtype: torch.dtype, head_dim: int, backward: bool = False, **options) -> str:
    """The kernel attnx.attention (``backward``: its backward) runs on ``device`` for ``dtype`` at head dim
    ``head_dim`` (D = Dv) with ``options`` (attnx.attention's keyword arguments): the backend's own answer
    (``torch.ops.attnx._attention_kernel``, from the plan its kernels run by), e.g. ``"cuda mma fp16 bucket
    64"``, ``"composite"``, ``"cpu avx2"``; the error's message where the backend refuses the call."""
    q = torch.zeros(1, 1, 1, head_dim, dtype=dtype, device=device)
    if options.get("dropout_p"):
        options.setdefault("dropout_seed", torch.zeros(2, dtype=torch.int64))
    try:
        return torch.ops.attnx._attention_kernel(q, q, q, backward=backward, **options)
    except RuntimeError as e:
        return f"none ({str(e).splitlines()[0]})"


def arch_code(arch_list: str, capability: tuple[int, int]) -> str | None:
    """What of code built for ``arch_list`` (TORCH_CUDA_ARCH_LIST's form, ``"8.0;9.0+PTX"``) a device of
    compute ``capability`` runs: ``"cubin"`` (a cubin for X.Y runs on X.y for y >= Y; an arch-specific one,
    ``9.0a``, on X.Y only), ``"ptx"`` (no cubin does, but PTX for an earlier arch, which the driver compiles
    for the device at first use), ``"none"``; None when the list is not made of numbered archs."""
    code = "none"
    for entry in filter(None, re.split(r"[;,\s]+", arch_list)):
        match = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", entry)
        if match is None:
            return None
        arch, suffix = (int(match[1]), int(match[2])), match[3]
        if suffix == "a":
            cubin = tuple(capability) == arch
        else:
            cubin = capability[0] == arch[0] and capability[1] >= arch[1]
        if cubin:
            return "cubin"
        if match[4] and suffix != "a" and tuple(capability) >= arch:
            code = "ptx"
    return code


def arch_runs(arch_list: str, capability: tuple[int, int]) -> bool | None:
    """Whether code built for ``arch_list`` runs on a device of compute ``capability`` (arch_code), as a
    cubin or as PTX; None when the list is not made of numbered archs."""
    code = arch_code(arch_list, capability)
    return None if code is None else code != "none"


def _build_info() -> dict:
    """What setup.py recorded about this build (attnx/_build_info.py), or ``{}`` for a build without it."""
    try:
        from attnx import _build_info
    except ImportError:  # built by something other than setup.py
        return {}
    return {name: getattr(_build_info, name, None)
            for name in ("BACKENDS", "TORCH_VERSION", "MIN_TORCH", "CUDA_ARCH_LIST")}


def header_lines() -> list[str]:
    """Version, torch, the build and the devices torch sees."""
    build = _build_info()
    backends = ", ".join(build["BACKENDS"]) if build.get("BACKENDS") else "unknown"
    archs = build.get("CUDA_ARCH_LIST")
    return [
        f"attnx {attnx.__version__}",
        f"python {platform.python_version()}, torch {torch.__version__} "
        f"(attnx built against {build.get('TORCH_VERSION') or 'unknown'}, loads under torch >= "
        f"{build.get('MIN_TORCH') or 'unknown'})",
        f"backends compiled: {backends}" + (f" (CUDA archs {archs})" if archs else "")
        + f"; loaded: {', '.join(_loader.loaded_backends())}",
        f"devices: cuda available={torch.cuda.is_available()}, "
        f"mps available={torch.backends.mps.is_available()}",
    ]


def op_lines() -> list[str]:
    """One line per public op: the backends it has kernels for in this process."""
    width = max(len(op) for op in KERNEL_OPS)
    lines = ["public ops (backends with kernels loaded; composite: built from other ops):"]
    for op in KERNEL_OPS:
        backends = [f"{b} (composite)" if kind == "composite" else b for b, kind in op_backends(op).items()]
        lines.append(f"  {op:<{width}}  {', '.join(backends) or 'none'}")
    return lines


def cpu_line() -> str:
    """The ISA level of the CPU attention kernels, beside torch's own."""
    asked = [f"{name}={os.environ[name]}" for name in ("ATEN_CPU_CAPABILITY", "ATTNX_CPU_CAPABILITY")
             if name in os.environ]
    return (f"CPU attention kernels: {cpu_isa()} (torch's CPU kernels: "
            f"{torch.backends.cpu.get_cpu_capability()}" + "".join(f"; {a}" for a in asked) + ")")


# The head dims and dtypes kernel_lines asks about: one per CUDA head-dim bucket and one past the last.
KERNEL_HEAD_DIMS = (64, 128, 256, 512)


def kernel_lines(device) -> list[str]:
    """The kernel attention takes on ``device`` for each dtype at each of KERNEL_HEAD_DIMS, with dropout, and
    for its backward, as the backend names them (attention_kernel)."""
    lines = []
    for dtype in CUDA_DTYPES:
        by_dim = "; ".join(f"D={d}: {attention_kernel(device, dtype, d)}" for d in KERNEL_HEAD_DIMS)
        dropout = attention_kernel(device, dtype, 64, dropout_p=0.1)
        backward = attention_kernel(device, dtype, 64, backward=True)
        lines.append(f"  {str(dtype).removeprefix('torch.'):<9} {by_dim}; D=64 with dropout: {dropout}; "
                     f"backward at D=64: {backward}")
    return lines


def cuda_lines() -> list[str]:
    """The CUDA attention kernel each dtype takes on each visible GPU, or why attention has none here."""
    build = _build_info()
    if "CUDA" not in op_backends("attnx::attention"):
        if torch.version.cuda is None:
            why = "torch is a CPU build"
        elif build.get("BACKENDS") and "CUDA" not in build["BACKENDS"]:
            why = "this build of attnx has no CUDA kernels"
        else:
            why = "attnx's CUDA library is not loaded"
        return [f"CUDA attention: none ({why})"]
    archs = build.get("CUDA_ARCH_LIST")
    built = f"kernels built for CUDA archs {archs}" if archs else "CUDA archs of the build not recorded"
    if _loader.cuda_route() == "run-time compiled":
        archs = None  # NVRTC compiles for whichever GPU a call runs on
        built = "kernels compiled at run time for each GPU"
    if not torch.cuda.is_available():
        return [f"CUDA attention: no CUDA device visible ({built})"]
    lines = []
    for index in range(torch.cuda.device_count()):
        capability = torch.cuda.get_device_capability(index)
        device = (f"cuda:{index} ({torch.cuda.get_device_name(index)}, "
                  f"sm_{capability[0]}{capability[1]})")
        code = arch_code(archs, capability) if archs else None
        if code == "none":
            lines.append(f"CUDA attention on {device}: none, attnx's kernels are not built for it ({built})")
            continue
        jit = ", from the build's PTX, which the driver compiles for it at first use" if code == "ptx" else ""
        lines.append(f"CUDA attention on {device}{jit}:")
        lines += kernel_lines(f"cuda:{index}")
    return lines


def runtime_compiler_line() -> str:
    """The run-time CUDA compiler (attnx._C_nvrtc): the NVRTC it would use and its disk cache, read without
    setting it up (nothing is created or compiled)."""
    from attnx import _cuda_runtime

    why = _cuda_runtime.missing()
    if why:
        return f"CUDA run-time compiler: none ({why})"
    path = _cuda_runtime.nvrtc_library()[0]
    try:
        major, minor = ctypes.c_int(), ctypes.c_int()
        ctypes.CDLL(path).nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        nvrtc = f"NVRTC {major.value}.{minor.value} ({path})"
    except OSError as error:
        nvrtc = f"NVRTC at {path} does not load ({error})"
    folder = _cuda_runtime.cache_dir()
    if not folder:
        cache = "no disk cache (ATTNX_CUDA_CACHE=0)"
    else:
        entries = glob.glob(os.path.join(folder, "*.kernel"))
        size = sum(os.path.getsize(e) for e in entries)
        cache = f"cache {folder} ({len(entries)} kernels, {size / 2**20:.1f} MiB)"
    serves = ("serves CUDA in this process" if _loader.cuda_route() == "run-time compiled"
              else "not used: the prebuilt library serves CUDA" if _loader.cuda_route() == "prebuilt"
              else "not serving CUDA")
    return f"CUDA run-time compiler: {nvrtc}; {cache}; {serves}"


def backward_lines() -> list[str]:
    """Whether attention's backward (which mha's calls) is a fused kernel on each backend attention has."""
    texts = {
        "kernel": "fused kernel: probabilities recomputed tile by tile, nothing of size (B, H, L, S)",
        "composite": "composite of torch's ops: stores the (B, H, L, S) probabilities and their gradient; "
                     "no dropout",
    }
    kinds = backend_kinds("attnx::attention_backward")
    lines = ["backward (attnx::attention_backward, which attnx::mha_backward calls):"]
    for backend, kind in kinds.items():
        text = texts[kind]
        if backend == "CUDA" and kind == "kernel":
            text = ("the fused kernels or the whole-tensor math, as the CUDA lines name them per device "
                    "(ATTNX_CUDA_FUSED_BACKWARD=1 asks for the fused ones, not yet run on a GPU)")
        lines.append(f"  {backend:<4}  {text}")
    return lines


def integrations() -> dict[str, str | None]:
    """Each library attnx.integrations adapts: its version ("" when unrecorded) where it can be imported,
    else None. Found without importing it (importing transformers alone takes seconds)."""
    found = {}
    for module, distribution in INTEGRATIONS:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):  # a broken install, or a module without a spec
            spec = None
        if spec is None:
            found[module] = None
            continue
        try:
            found[module] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            found[module] = ""
    return found


def integrations_line() -> str:
    """The libraries attnx has integrations for, found or not."""
    versions = integrations()
    present = [f"{name} {version}".strip() for name, version in versions.items() if version is not None]
    absent = [name for name, version in versions.items() if version is None]
    return "integrations: " + "; ".join(
        ([", ".join(present)] if present else []) + ([f"not found: {', '.join(absent)}"] if absent else [])
    )


def sdpa_line() -> str:
    """Whether F.scaled_dot_product_attention's CPU kernels are attnx's now (attnx.sdpa)."""
    if attnx.sdpa.is_enabled():
        return "SDPA takeover (attnx.sdpa): on: F.scaled_dot_product_attention on CPU runs attnx's kernels"
    return ('SDPA takeover (attnx.sdpa): off (on: torch.nn.attention.activate_flash_attention_impl("attnx") '
            "or attnx.sdpa.enable())")


def dispatch_lines() -> list[str]:
    """Every attnx op, internal ones included, with the dispatch keys it has kernels for."""
    width = max((len(op) for op in ops()), default=0)
    return ["ops (dispatch keys with a kernel):"] + [
        f"  {op:<{width}}  {' '.join(kernels(op))}" for op in ops()
    ]


def report(verbose: bool = False) -> str:
    """What ``python -m attnx.info`` prints: attnx's and torch's versions, the build and the devices; the
    backends each public op has kernels for; the CPU kernels' ISA level; the CUDA kernel each dtype takes on
    each visible GPU (or why none); the run-time CUDA compiler's NVRTC, cache and use; whether the backward is
    fused on each backend; whether the SDPA takeover is on; the integrations' libraries found. ``verbose``
    (``--ops``) adds every op's dispatch keys."""
    lines = header_lines() + op_lines() + [cpu_line()] + cuda_lines() + [runtime_compiler_line()]
    lines += backward_lines()
    return "\n".join(lines + [sdpa_line(), integrations_line()] + (dispatch_lines() if verbose else []))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m attnx.info", description=__doc__.splitlines()[0])
    parser.add_argument("--ops", "--verbose", "-v", dest="verbose", action="store_true",
                        help="also list every attnx op, internal ones included, with its dispatch keys")
    print(report(verbose=parser.parse_args(argv).verbose))


if __name__ == "__main__":
    main()
