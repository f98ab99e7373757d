// attnx: the op surface. Every schema is defined here and nowhere else; backends only add
// STABLE_TORCH_LIBRARY_IMPL(attnx, <Key>) blocks at the bottom of their own files, through the adapters of
// common/attention.h (attention's arguments after value are AttentionOptions there, mha's are MhaArgs in
// common/mha.h; python/attnx reads the names and defaults from these schemas). A new argument is declared
// here, in that struct, in python/attnx/reference.py (its semantics, as code), in python/attnx/ops.py (its
// docstring, the one prose statement of what it does) and in the kernels that use it (csrc/README.md).
//
// linear, attention and mha are differentiable, and each is three ops. The public one (`attention`) is a
// router (common/routes.cpp): with grad mode off it runs the kernel op (`_attention`), which has no autograd
// kernel and so costs nothing beyond the kernel; with grad mode on it runs the same kernels under a second
// name
// (`_attention_autograd`, for mha: `mha_forward`), whose autograd is registered from Python
// (python/attnx/_autograd.py). A Python autograd kernel runs on every call of its op, grad mode or not
// (~10 us), as much as the whole op at decoding shapes: the router keeps it off no-grad calls.
#include <Python.h>
#include <torch/csrc/stable/library.h>

// `import attnx._C` only has to load this library so that the static registrars of every file run; the module
// itself is empty, which keeps it free of pybind11 and within Python's limited API.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

// The schema strings are laid out by argument, not by clang-format.
// clang-format off
STABLE_TORCH_LIBRARY(attnx, m) {
  // F.linear for every input layout: leading dims that form one dense block (in any order) fold into a single
  // GEMM without a copy; the output keeps the memory order of input's leading dims.
#define ATTNX_LINEAR_SIGNATURE "(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor"
  m.def("linear" ATTNX_LINEAR_SIGNATURE);
  m.def("_linear" ATTNX_LINEAR_SIGNATURE);
  m.def("_linear_autograd" ATTNX_LINEAR_SIGNATURE);
  // Fused scaled dot-product attention on (B, H, L, D) queries and (B, Hkv, S, D) / (B, Hkv, S, Dv) keys and
  // values of any strides, Hkv dividing H (grouped KV heads: query head h reads kv head h / (H / Hkv), never a
  // copy), with nn.MultiheadAttention's masks (bool True = masked out, float added; (L, S), (B*H, L, S) or 4-D
  // broadcastable attn_mask, (B, S) key_padding_mask), read in place. Returns out (B, H, L, Dv) in memory
  // order (B, L, H, Dv) and the logsumexp lse (B, H, L) (+inf on rows that see no key) that the backward
  // recomputes from. dropout_p > 0 drops each probability with probability dropout_p (and scales the kept
  // ones by 1 / (1 - dropout_p)) before P V; the mask is a pure function of dropout_seed, a CPU int64 tensor
  // (seed, offset) of shape (2,) (a tensor, so that torch.compile does not specialise on its value), and of
  // the element's (b, h, l, s), never stored (include/attnx/philox.h). lse is that of the undropped scores.
  // Which keys a row sees (include/attnx/key_range.h): is_causal (top-left), key_lengths (B,) int32/int64
  // (keys at or past key_lengths[b] are ignored) and a window (window_left, window_right) around the
  // bottom-right-aligned diagonal, -1 = unbounded. softcap > 0 turns each scaled score x into
  // softcap * tanh(x / softcap) before the masks. sinks (H,) join each row's softmax denominator (and lse).
  // A block-sparse mask: block_map int32 (B or 1, H or 1, ceil(L / block_q), ceil(S / block_k)) says for each
  // (query block, key block) whether its rows see none of its keys (-1: never read), all of them (-2), or
  // those whose bit is clear in block_bits[p] (p >= 0; block_bits int32 (P, block_q, ceil(block_k / 32)),
  // bit j of word w of a row: key 32 w + j of the block, set = masked out) (include/attnx/params.h).
  // The options, attention's arguments after value (common/attention.h, AttentionOptions), are the same in
  // attention_backward.
#define ATTNX_ATTENTION_OPTIONS                                                                            \
  "Tensor? attn_mask=None, Tensor? key_padding_mask=None, bool is_causal=False, float? scale=None, "      \
  "float dropout_p=0.0, Tensor? dropout_seed=None, int window_left=-1, int window_right=-1, "             \
  "Tensor? key_lengths=None, float? softcap=None, Tensor? sinks=None, Tensor? block_map=None, "            \
  "Tensor? block_bits=None, int block_q=128, int block_k=128"
#define ATTNX_ATTENTION_SIGNATURE \
  "(Tensor query, Tensor key, Tensor value, " ATTNX_ATTENTION_OPTIONS ") -> (Tensor out, Tensor lse)"
  m.def("attention" ATTNX_ATTENTION_SIGNATURE);
  m.def("_attention" ATTNX_ATTENTION_SIGNATURE);
  m.def("_attention_autograd" ATTNX_ATTENTION_SIGNATURE);
  // The gradients of attention's out, FlashAttention-2 style: the probabilities are recomputed tile by tile
  // from the saved lse and never stored. Same arguments and semantics as attention; grad_out and out
  // (B, H, L, Dv), lse (B, H, L) as attention returned them, any strides. Returns grad_query (B, H, L, D),
  // grad_key (B, Hkv, S, D) and grad_value (B, Hkv, S, Dv) in query's dtype, each in memory order (B, N, H, E)
  // like out (a kv head's gradients summed over its group of query heads); grad_attn_mask, attn_mask's
  // gradient in its shape and dtype (summed over the dims it broadcasts along), when grad_attn_mask is set
  // and attn_mask is a float mask, else empty; grad_sinks (H,) in sinks' dtype when sinks are given, else
  // empty. A row that sees no key contributes 0. No gradient flows through lse. With the forward's dropout_p
  // and dropout_seed, the dropout mask is regenerated, not read.
  m.def(
      "attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
      ATTNX_ATTENTION_OPTIONS ", bool grad_attn_mask=False) -> "
      "(Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_attn_mask, Tensor grad_sinks)");
  // The whole nn.MultiheadAttention forward in one dispatch: query (L, B, E), key (S, B, kdim), value
  // (S, B, vdim), or with batch_first (B, L, E), (B, S, kdim), (B, S, vdim) (read through their strides, so a
  // batch_first module needs no transposes around the call); any strides. Packed in_proj_weight or separate
  // q/k/v weights, bias_k/bias_v, add_zero_attn, static_k/static_v (B*H, S, E/H), both masks as attention
  // reads them (never merged), is_causal applied as a mask, dropout_p / dropout_seed as attention takes them
  // (not with need_weights). Returns out (L, B, E) ((B, L, E) with batch_first), lse (B, H, L) and the
  // attention weights when need_weights ((B, L, S') averaged over heads or (B, H, L, S')), else an empty
  // tensor. batch_first comes last so that positional calls written before it existed keep their meaning.
  // (The arguments before dropout_p are also mha_backward's, which takes dropout_p, dropout_seed and
  // batch_first in other places: common/mha.h, MhaArgs, holds them all.)
#define ATTNX_MHA_LEADING_ARGUMENTS                                                                      \
  "Tensor query, Tensor key, Tensor value, int num_heads, Tensor? in_proj_weight, Tensor? in_proj_bias, " \
  "Tensor? q_proj_weight, Tensor? k_proj_weight, Tensor? v_proj_weight, Tensor? bias_k, Tensor? bias_v, " \
  "bool add_zero_attn, Tensor out_proj_weight, Tensor? out_proj_bias, Tensor? key_padding_mask, "          \
  "Tensor? attn_mask, bool is_causal, Tensor? static_k, Tensor? static_v, bool need_weights, "             \
  "bool average_attn_weights"
#define ATTNX_MHA_ARGUMENTS \
  "(" ATTNX_MHA_LEADING_ARGUMENTS ", float dropout_p=0.0, Tensor? dropout_seed=None, bool batch_first=False)"
  m.def("mha" ATTNX_MHA_ARGUMENTS " -> (Tensor out, Tensor lse, Tensor weights)");
  m.def("_mha" ATTNX_MHA_ARGUMENTS " -> (Tensor out, Tensor lse, Tensor weights)");
  // mha for autograd (what attnx::mha runs in grad mode): mha's outputs plus
  // what its backward reads, nothing of size (B, H, L, S): attention's inputs q (B, H, L, Dh), k and v
  // (B, H, S', Dh) with the appended keys, and its output attn (B, H, L, Dh). k (v) is empty where static_k
  // (static_v) is attention's key as it is (no add_zero_attn): outputs never alias inputs.
  m.def("mha_forward" ATTNX_MHA_ARGUMENTS
        " -> (Tensor out, Tensor lse, Tensor weights, Tensor q, Tensor k, Tensor v, Tensor attn)");
  // mha's backward in one dispatch: grad_out (L, B, E) ((B, L, E) with batch_first) and, when the weights were
  // asked for and used, grad_weights; mha's arguments; mha_forward's lse, q, k, v and attn. Returns the
  // gradients of query, key, value (each in its argument's shape), in_proj_weight, in_proj_bias,
  // q/k/v_proj_weight, bias_k, bias_v, out_proj_weight, out_proj_bias, static_k, static_v and a float
  // attn_mask (in its shape and dtype, summed over the dims it broadcasts along), in that order,
  // each where output_mask asks for it and an empty tensor elsewhere. When query, key and value are one
  // tensor, grad_query is the gradient of all three.
  m.def(
      "mha_backward(Tensor grad_out, Tensor? grad_weights, " ATTNX_MHA_LEADING_ARGUMENTS
      ", float dropout_p, Tensor? dropout_seed, Tensor q, Tensor k, Tensor v, Tensor attn, Tensor lse, "
      "int[] output_mask, bool batch_first=False) -> Tensor[]");
  // attention over N packed sequences of different lengths (FlashAttention's varlen layout): query
  // (total_q, H, D), key (total_k, Hkv, D) and value (total_k, Hkv, Dv) of any strides, sequence b's queries
  // being rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 and its keys rows cu_seqlens_k[b] ..
  // cu_seqlens_k[b + 1] - 1 (cu_seqlens_* int32 (N + 1,), contiguous, non-decreasing); each sequence attends
  // only to its own keys, and the kernels never cross a sequence (the cost is the sum of Lq_b * Lk_b, not
  // total_q * total_k). max_seqlen_q / max_seqlen_k bound the sequences' lengths (checked on the CPU). Which
  // keys a row sees is attention's window, aligned bottom-right per sequence (query i of a sequence with Lq
  // queries and Lk keys sits at key position i + Lk - Lq): is_causal is that window's right side at the
  // diagonal (FlashAttention's and torch.nn.attention.varlen's causal, not SDPA's top-left), combined with
  // (window_left, window_right), -1 = unbounded. seqused_k (N,) int32 cuts sequence b to its first
  // seqused_k[b] keys (at most its cu_seqlens_k slot). With block_table (N, pages_per_seq) int32, key and value
  // are a paged cache (pages, page_size, Hkv, D) / (.., Dv) of any page size: key j of sequence b is row
  // j % page_size of page block_table[b, j // page_size], gathered per tile, never copied out; cu_seqlens_k
  // then gives each sequence's key count. softcap and sinks as attention's. Returns out (total_q, H, Dv) and
  // lse (H, total_q) (float32, float64 for float64 inputs; +inf on rows that see no key, out 0 there and on
  // rows outside every sequence). Same router as attention (_varlen_attention / _varlen_attention_autograd).
#define ATTNX_VARLEN_OPTIONS                                                                               \
  "int max_seqlen_q, int max_seqlen_k, bool is_causal=False, float? scale=None, int window_left=-1, "       \
  "int window_right=-1, Tensor? seqused_k=None, Tensor? block_table=None, float? softcap=None, "            \
  "Tensor? sinks=None"
#define ATTNX_VARLEN_SIGNATURE                                                                         \
  "(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, Tensor cu_seqlens_k, " ATTNX_VARLEN_OPTIONS \
  ") -> (Tensor out, Tensor lse)"
  m.def("varlen_attention" ATTNX_VARLEN_SIGNATURE);
  m.def("_varlen_attention" ATTNX_VARLEN_SIGNATURE);
  m.def("_varlen_attention_autograd" ATTNX_VARLEN_SIGNATURE);
  // varlen_attention's gradients, as attention_backward computes attention's (the same kernel, one batch per
  // sequence): grad_out and out (total_q, H, Dv), lse (H, total_q) as varlen_attention returned them, and
  // its arguments. Returns grad_query (total_q, H, D), grad_key (total_k, Hkv, D), grad_value
  // (total_k, Hkv, Dv) (0 for keys no query sees, seqused_k's cut included) and grad_sinks (H,) when sinks
  // are given, else empty. No block_table: a paged cache is inference only.
  m.def(
      "varlen_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
      "Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, " ATTNX_VARLEN_OPTIONS ") -> "
      "(Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_sinks)");
  // The SDPA takeover (csrc/pytorch/sdpa.cpp): _sdpa_takeover(on) makes attnx's CPU kernels those of
  // aten::_scaled_dot_product_flash_attention_for_cpu and its backward (on = True) or gives PyTorch's back
  // (False), and returns whether it was on before (None: only that); keep_bf16_forward / keep_fp16_forward
  // leave those dtypes' forwards to PyTorch's kernel. The two fallbacks have the aten ops' schemas: PyTorch's
  // own kernels, for the calls attnx's do not take (registered from python/attnx/sdpa.py).
  m.def("_sdpa_takeover(bool? on=None, bool keep_bf16_forward=False, bool keep_fp16_forward=False) -> bool");
  m.def("_sdpa_for_cpu_fallback(Tensor query, Tensor key, Tensor value, float dropout_p=0.0, "
        "bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) -> "
        "(Tensor output, Tensor logsumexp)");
  m.def("_sdpa_for_cpu_backward_fallback(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
        "Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None, "
        "float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  // The kernel attention (backward = False) or attention_backward (True) runs for these arguments on query's
  // device: the backend's own answer, from the same plan its run function takes (cpu/attention.cpp,
  // cuda/attention_plan.h, mps/metal_plan.h), e.g. "cpu avx2", "cuda mma fp16 bucket 64", "cuda simt fp32
  // bucket 128", "cuda composite", "cuda fused mma fp16 bucket 64", "metal tiled float16 bucket 64",
  // "math" (the whole-tensor backward of common/attention_math.cpp).
  // Where the backend refuses the call, the same error the call would raise. python -m attnx.info, the
  // tests' skips, tools/ and the benchmarks' labels ask it rather than restate a rule.
  m.def("_attention_kernel(Tensor query, Tensor key, Tensor value, " ATTNX_ATTENTION_OPTIONS
        ", bool backward=False) -> str");
  // The ISA level attention's CPU kernels (forward and backward) run at in this process: "avx512", "avx2" or
  // "default" (cpu/attention_kernel.h, cpu_capability()). Asked of the library rather than recomputed in
  // Python, so that `python -m attnx.info` reports the level the kernels were picked for, build included.
  m.def("_cpu_capability() -> str");
  // Whether attention's CUDA calls that torch's own flash kernel computes exactly as attnx does (unmasked
  // float16/bfloat16, cuda/attention_plan.h: torch_flash_supports) run on it in this process: on unless
  // ATTNX_CUDA_TORCH_FLASH=0, or after torch refused such a call. `on` sets it, for the benchmarks that time
  // attnx's own kernel beside torch's. CUDA builds only.
  m.def("_cuda_torch_flash(bool? on=None) -> bool");
  // The tile shape the tensor-core forward's unmasked instantiation runs in ("32x64 w4 s2": query rows a warp
  // x keys a tile, warps a block, pipeline stages; cuda/attention_plan.h, MmaShape), or "" for each dtype
  // and head dim's default. `shape` sets it, for gpu-check's sweep of the family; shapes other than the
  // defaults run on the kernels compiled at run time. CUDA builds only.
  m.def("_cuda_mma_shape(str? shape=None) -> str");
  // The CUDA kernels compiled at run time by the user's NVRTC (attnx._C_nvrtc, csrc/rtc/compiler.h), for the
  // CUDA majors and GPUs the prebuilt library does not serve; python/attnx/_cuda_runtime.py calls these.
  // configure: NVRTC, its headers' folders (':'-separated) and the disk cache -> [NVRTC's version, why the
  // cache folder was refused or "", the embedded sources' hash]. compile: one kernel (a name expression of an
  // embedded source) for sm_arch -> [where it came from: memory, disk or compiled; its cache key; its lowered
  // name]. options: NVRTC's options for sm_arch. cache: [entries, bytes] of the disk cache in use, [] for
  // none. driver: the CUDA driver's version; raises without one. enable: registers the library's CUDA kernels
  // (python/attnx/_loader.py, where the prebuilt library is not loaded) -> whether they were already.
  m.def("_cuda_runtime_configure(str nvrtc, str include_dirs, str cache_dir, int cache_max_bytes) -> str[]");
  m.def("_cuda_runtime_compile(str source, str kernel, int arch) -> str[]");
  m.def("_cuda_runtime_options(int arch) -> str[]");
  m.def("_cuda_runtime_cache() -> int[]");
  m.def("_cuda_runtime_driver() -> int");
  m.def("_cuda_runtime_enable() -> bool");
}
// clang-format on
