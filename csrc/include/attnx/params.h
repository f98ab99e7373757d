// attnx: torch-free parameter blocks shared by every backend (C++, CUDA and Metal include this file).
//
// Written in the common subset of C++ and the Metal Shading Language: fixed-width integers and float only, no
// std::, no pointers (data pointers and buffer offsets travel beside the struct: AttentionPointers for the C++
// and CUDA kernels, buffer bindings on Metal), no double (Metal has none).
#pragma once

#if defined(__METAL_VERSION__)
#include <metal_stdlib>
#elif !defined(__CUDACC_RTC__)  // NVRTC: attnx/rtc.h
#include <stdint.h>
#endif

namespace attnx {

// What an optional mask is: absent, boolean (true = masked out), or additive in the given floating type.
// Additive masks are read in their own type and converted to the accumulator type element by element.
enum MaskKind : int32_t {
  kMaskNone = 0,
  kMaskBool = 1,
  kMaskFloat16 = 2,
  kMaskBFloat16 = 3,
  kMaskFloat32 = 4,
  kMaskFloat64 = 5,
};

// attnx::attention on (B, H, L, D) queries, (B, H, S, D) keys and (B, H, S, Dv) values.
//
// Every stride is in elements, may be 0 (broadcast, e.g. a key expanded over heads) and is indexed in the
// logical order of the shape it belongs to. Masks are canonical: attn_mask is seen as (B, H, L, S) with
// stride 0 on every broadcast dim (an (L, S) mask has strides (0, 0, sL, sS); nn.MultiheadAttention's (B*H,
// L, S) mask is split into (B, H) as a view), and key_padding_mask as (B, S).
struct AttentionParams {
  int64_t batch;       // B
  int64_t heads;       // H
  int64_t q_len;       // L
  int64_t kv_len;      // S
  int64_t head_dim;    // D (query and key)
  int64_t v_head_dim;  // Dv (value and output)

  int64_t q_stride[4];    // (B, H, L, D)
  int64_t k_stride[4];    // (B, H, S, D)
  int64_t v_stride[4];    // (B, H, S, Dv)
  int64_t out_stride[4];  // (B, H, L, Dv)
  int64_t lse_stride[3];  // (B, H, L)

  int64_t attn_mask_stride[4];         // (B, H, L, S), 0 on broadcast dims
  int64_t key_padding_mask_stride[2];  // (B, S)
  int32_t attn_mask_kind;              // MaskKind
  int32_t key_padding_mask_kind;       // MaskKind

  // Key s is masked for query l when s > l (top-left aligned, as SDPA's is_causal).
  int32_t is_causal;

  // The softmax scale as an unevaluated sum scale + scale_lo of two floats: float kernels use `scale`;
  // float64 kernels use (double)scale + (double)scale_lo, which carries ~48 bits of the double the caller
  // passed without a double field, which Metal lacks.
  float scale;
  float scale_lo;

  // Dropout on the probabilities (see attnx/philox.h): with `dropout` set, element (b, h, l, s) is kept when
  // the Philox4x32-10 draw for it, under key dropout_seed and counter offset dropout_offset, is below
  // dropout_threshold = floor((1 - p) * 2^32), and a kept probability is scaled by 1 / (1 - p) =
  // dropout_scale + dropout_scale_lo (split like `scale`; 0 when p == 1, where nothing is kept). 64-bit
  // values travel as (low, high) uint32 pairs.
  uint32_t dropout_seed[2];
  uint32_t dropout_offset[2];
  uint32_t dropout_threshold;
  int32_t dropout;  // 0: no dropout (p == 0), and the other dropout fields are unused
  float dropout_p;
  float dropout_scale;
  float dropout_scale_lo;

  // Grouped key/value heads (GQA; MQA when 1): key and value have kv_heads heads, which divides `heads`;
  // query head h reads kv head h / (heads / kv_heads), through k_stride[1] / v_stride[1] (which step kv
  // heads). Never a copy: a group's query heads index the same key and value rows.
  int64_t kv_heads;
  // Which keys each query row may see besides the masks: a window of window_left keys before and window_right
  // after the bottom-right-aligned diagonal (-1: unbounded), and per-batch key lengths (keys past them are
  // never seen), on top of is_causal. The rule is attnx.reference.key_range_mask; attnx/key_range.h computes
  // it for the kernels.
  int64_t window_left;
  int64_t window_right;
  int64_t key_lengths_stride;  // along B; key_lengths (B,) is read as int32 or int64, per key_lengths_kind
  int32_t key_lengths_kind;    // KeyLengthsKind
  // Attention sinks: one logit per query head, sinks (H,) in the accumulator type, contiguous. A sink joins
  // every row's softmax denominator (lse includes it) and takes probability mass, but adds no value.
  int32_t has_sinks;
  // Soft-capping: when softcap > 0, every scaled score x becomes softcap * tanh(x / softcap) before the masks
  // are added. Split like `scale`: float64 kernels use (double)softcap + (double)softcap_lo.
  float softcap;
  float softcap_lo;

  // Variable length (attnx::varlen_attention): with `varlen` set, the B batches are B packed sequences of
  // different lengths. Sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of query, out
  // and lse (q_stride[2], out_stride[2] and lse_stride[2] step those rows; the batch strides q_stride[0],
  // out_stride[0] and lse_stride[0] are 0), its keys are cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows from
  // cu_seqlens_k[b] (k_stride[2], v_stride[2]), cut to key_lengths[b] (seqused_k) when given. The key range
  // of attnx/key_range.h applies per sequence, with that sequence's query and key counts. q_len and kv_len
  // are the longest sequence's, which size the tiles: a tile never crosses a sequence boundary.
  // With page_size > 0 the keys and values are a paged cache (pages, page_size, Hkv, D): key s of sequence b
  // is row s % page_size of page block_table[b, s / page_size] (block_table (B, pages_per_seq) int32 through
  // block_table_stride), k_stride[0] / v_stride[0] stepping pages and k_stride[2] / v_stride[2] rows of a
  // page. The offsets and the table travel in AttentionPointers. Backends without these refuse them.
  int64_t page_size;              // 0: keys are rows of key and value, not pages
  int64_t block_table_stride[2];  // (B, pages_per_seq)
  int64_t pages_per_seq;
  int32_t varlen;
  int32_t varlen_reserved;  // 0; pads the struct to a multiple of 8 bytes, as Metal lays it out

  // A block-sparse mask (has_block_map): the (L, S) plane cut into blocks of block_q queries by block_k
  // keys (the last ones cut at L and S). Entry (b, h, qb, kb) of block_map, an int32 (B, H,
  // ceil(L / block_q), ceil(S / block_k)) tensor read through block_map_stride (0 on broadcast dims), says
  // what the rows of query block qb see of key block kb: kBlockEmpty nothing (the block is never read),
  // kBlockFull every key (no mask is read), p >= 0 the keys whose bit is clear in block_bits[p]: int32
  // (P, block_q, ceil(block_k / 32)) bit rows through block_bits_stride, bit j of word w of row r being key
  // 32 w + j of the block (set: masked out, as a bool mask's True). It combines with every other mask and
  // the key range.
  int64_t block_map_stride[4];   // (B, H, query blocks, key blocks)
  int64_t block_bits_stride[3];  // (P, block_q, ceil(block_k / 32))
  int64_t block_q;
  int64_t block_k;
  int32_t has_block_map;
  // The PARTIAL blocks block_bits holds (P; 0 without it). The CPU checks every entry on the host; a device
  // kernel, which cannot without a synchronisation, reads an entry that is neither kBlockFull nor below P
  // as kBlockEmpty, never past block_bits.
  int32_t block_partial;
};

// block_map's entries besides an index into block_bits (AttentionParams::has_block_map).
enum BlockClass : int32_t {
  kBlockEmpty = -1,
  kBlockFull = -2,
};

// How per-batch key lengths are stored.
enum KeyLengthsKind : int32_t {
  kKeyLengthsNone = 0,  // every batch has S valid keys
  kKeyLengthsInt32 = 1,
  kKeyLengthsInt64 = 2,
};

#if !defined(__METAL_VERSION__)
// The layout Metal sees: 31 int64 fields, 14 four-byte fields (the dropout fields), then 4 int64 and 4
// four-byte fields (GQA, the key range, sinks and soft-capping), then 4 int64 and 2 four-byte fields
// (variable length and paging), then 9 int64 and 2 four-byte fields (the block-sparse mask): each group
// appended last, so that every earlier offset is unchanged.
static_assert(sizeof(AttentionParams) == 472, "AttentionParams layout changed: update the Metal side too");

// Where an attention call's tensors start (storage offsets applied); their layouts are in AttentionParams.
struct AttentionPointers {
  const void* query;
  const void* key;
  const void* value;
  const void* attn_mask;         // nullptr when absent
  const void* key_padding_mask;  // nullptr when absent
  void* out;
  void* lse;                // float32, or float64 for float64 inputs
  const void* key_lengths;  // (B,) int32 or int64; nullptr when absent
  const void* sinks;        // (H,) in the accumulator type, contiguous; nullptr when absent
  // With AttentionParams::varlen: the sequences' offsets, (B + 1,) int32 contiguous each, and with
  // page_size > 0 the block table (B, pages_per_seq) int32; nullptr otherwise.
  const void* cu_seqlens_q;
  const void* cu_seqlens_k;
  const void* block_table;
  // With AttentionParams::has_block_map: block_map and block_bits (int32, their layouts in the params);
  // nullptr otherwise.
  const void* block_map;
  const void* block_bits;
};
#endif

// attnx::attention_backward: the forward's problem plus the layouts of the incoming gradient and of the three
// gradients it returns. In `fwd`, out_stride and lse_stride describe the saved out and lse (inputs here).
struct AttentionBackwardParams {
  AttentionParams fwd;
  int64_t grad_out_stride[4];    // (B, H, L, Dv)
  int64_t grad_query_stride[4];  // (B, H, L, D)
  int64_t grad_key_stride[4];    // (B, H, S, D)
  int64_t grad_value_stride[4];  // (B, H, S, Dv)
  // attn_mask's gradient, summed over the dims the mask broadcasts along: a contiguous buffer of these sizes
  // (B or 1, H or 1, L or 1, S or 1) in the accumulator type; all 0 when it is not asked for.
  int64_t grad_attn_mask_size[4];
};

#if !defined(__METAL_VERSION__)
static_assert(sizeof(AttentionBackwardParams) == 472 + 20 * 8,
              "AttentionBackwardParams layout changed: update the Metal side too");

// Where an attention_backward call's tensors start (storage offsets applied); their layouts are in
// AttentionBackwardParams. In `fwd`, out and lse are the saved forward outputs, read here.
struct AttentionBackwardPointers {
  AttentionPointers fwd;
  const void* grad_out;
  void* grad_query;
  void* grad_key;
  void* grad_value;
  void* grad_attn_mask;  // zeroed buffer of grad_attn_mask_size; nullptr when not asked for
};
#endif

// attnx::linear on a backend that runs its own GEMM kernel (Metal): out (M, N) = input (M, K) @ weight.T +
// bias.
//
// The M rows of input and of out are indexed as (outer, inner) = (r / rows_inner, r % rows_inner), each with
// its own element stride in either tensor, so an (L, B, E) view of batch-first data of any strides (the B=1
// transpose included) is read in place, and its output row r is written where linear's layout puts it (the
// input's memory order of rows; common/linear.h), not at r * N; leading dims that merge into one row stride
// in both come with rows_inner = 1.
struct LinearParams {
  int64_t rows;          // M
  int64_t rows_inner;    // M = rows_outer * rows_inner
  int64_t in_features;   // K
  int64_t out_features;  // N

  int64_t input_stride[3];   // (rows_outer, rows_inner, K)
  int64_t weight_stride[2];  // (N, K)
  int64_t bias_stride;       // along N; 0 for a broadcast (size-1) bias
  int64_t out_stride[3];     // (rows_outer, rows_inner, N)
  int32_t has_bias;
  int32_t reserved;  // 0; pads the struct to a multiple of 8 bytes, as Metal lays it out
};

#if !defined(__METAL_VERSION__)
static_assert(sizeof(LinearParams) == 13 * 8 + 8, "LinearParams layout changed: update the Metal side too");
#endif

}  // namespace attnx
