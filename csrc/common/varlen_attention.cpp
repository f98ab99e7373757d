// attnx: argument checks, tensors -> AttentionParams (one batch per packed sequence) and the problems'
// unboxing and boxing for attnx::varlen_attention and attnx::varlen_attention_backward (see
// varlen_attention.h). The checks and helpers it shares with attention's glue are common/attention.cpp's.
#include "common/varlen_attention.h"

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "common/aten.h"
#include "common/stable.h"
#include "common/views.h"

namespace attnx {

namespace {

using stable::device_name;
using stable::Sizes;
using torch::headeronly::IntHeaderOnlyArrayRef;
using torch::stable::Device;

using detail::split_scale;

constexpr const char* kOp = "attnx::varlen_attention";

// What the checks read off the offsets on the CPU: the longest sequences, and whether the sequences cover
// every row of query (key), so that no row is left unwritten.
struct SeqStats {
  int64_t max_q = 0, max_k = 0;
  bool q_covered = true, k_covered = true;
};

void check_int32_vector(const Tensor& t, const char* name, int64_t n, const Tensor& query, bool contiguous) {
  ATTNX_CHECK(t.scalar_type() == ScalarType::Int, kOp, ": expected ", name, " of dtype int32, got ",
              t.scalar_type());
  ATTNX_CHECK(t.dim() == 1 && t.size(0) == n, kOp, ": expected ", name, " of shape (", n, ",), got ",
              Sizes{t.sizes()});
  ATTNX_CHECK(t.device() == query.device(), kOp, ": expected ", name, " on query's device ",
              device_name(query.device()), ", got ", device_name(t.device()));
  ATTNX_CHECK(!contiguous || n <= 1 || t.stride(0) == 1, kOp, ": expected ", name,
              " to be contiguous, got stride ", t.stride(0));
}

// cu_seqlens starts at >= 0, never decreases and ends at <= total (read on the CPU only). Returns the longest
// sequence; *covered: the sequences span rows [0, total).
int64_t check_offsets(const Tensor& t, const char* name, const char* rows_of, int64_t total, bool bounded,
                      bool* covered) {
  const int32_t* c = t.const_data_ptr<int32_t>();
  const int64_t n = t.size(0) - 1;
  ATTNX_CHECK(c[0] >= 0, kOp, ": expected ", name, "[0] >= 0, got ", c[0]);
  int64_t longest = 0;
  for (int64_t b = 0; b < n; ++b) {
    ATTNX_CHECK(c[b + 1] >= c[b], kOp, ": expected ", name, " to be non-decreasing, got ", name, "[", b,
                "] = ", c[b], " > ", name, "[", b + 1, "] = ", c[b + 1]);
    longest = std::max<int64_t>(longest, int64_t{c[b + 1]} - c[b]);
  }
  if (bounded) {
    ATTNX_CHECK(c[n] <= total, kOp, ": expected ", name, "[-1] <= ", total, " (the rows of ", rows_of,
                "), got ", c[n]);
  }
  *covered = c[0] == 0 && c[n] == total;
  return longest;
}

// Checks query, key, value and the options; on the CPU also the values of the offsets, seqused_k and the
// block table. Fills the sizes, strides, key range and pointers of the inputs into p and ptr.
SeqStats check_and_describe(const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& cu_q,
                            const Tensor& cu_k, const VarlenAttentionOptions& o, AttentionParams& p,
                            AttentionPointers& ptr) {
  const bool paged = o.block_table.has_value();
  ATTNX_CHECK(query.dim() == 3, kOp, ": expected query of shape (total_q, H, D), got a ", query.dim(),
              "-D tensor of shape ", Sizes{query.sizes()});
  const int kv_dims = paged ? 4 : 3;
  const char* k_shape = paged ? "(pages, page_size, Hkv, D) with block_table" : "(total_k, Hkv, D)";
  const char* v_shape = paged ? "(pages, page_size, Hkv, Dv) with block_table" : "(total_k, Hkv, Dv)";
  ATTNX_CHECK(key.dim() == kv_dims, kOp, ": expected key of shape ", k_shape, ", got a ", key.dim(),
              "-D tensor of shape ", Sizes{key.sizes()});
  ATTNX_CHECK(value.dim() == kv_dims, kOp, ": expected value of shape ", v_shape, ", got a ", value.dim(),
              "-D tensor of shape ", Sizes{value.sizes()});
  detail::check_query_key_value_dtypes_and_devices(kOp, query, key, value);
  const int64_t total_q = query.size(0), H = query.size(1), D = query.size(2);
  const int h_dim = paged ? 2 : 1;
  const int64_t Hkv = key.size(h_dim), Dv = value.size(kv_dims - 1);
  ATTNX_CHECK(key.size(kv_dims - 1) == D, kOp, ": expected key's last dim to be query's D = ", D, ", got ",
              Sizes{key.sizes()});
  detail::check_kv_heads(kOp, H, Hkv);
  for (int d = 0; d < kv_dims - 1; ++d) {
    ATTNX_CHECK(value.size(d) == key.size(d), kOp, ": expected value of shape ", v_shape,
                " to match key's leading dims ", Sizes{key.sizes()}, ", got ", Sizes{value.sizes()});
  }

  const int64_t N = cu_q.dim() == 1 ? cu_q.size(0) - 1 : -1;
  ATTNX_CHECK(N >= 0, kOp, ": expected cu_seqlens_q of shape (N + 1,), got ", Sizes{cu_q.sizes()});
  check_int32_vector(cu_q, "cu_seqlens_q", N + 1, query, true);
  check_int32_vector(cu_k, "cu_seqlens_k", N + 1, query, true);
  ATTNX_CHECK(o.max_seqlen_q >= 0 && o.max_seqlen_k >= 0, kOp,
              ": expected max_seqlen_q and max_seqlen_k >= 0, got (", o.max_seqlen_q, ", ", o.max_seqlen_k,
              ")");
  detail::check_window(kOp, o.window_left, o.window_right);
  if (o.seqused_k) check_int32_vector(*o.seqused_k, "seqused_k", N, query, false);
  int64_t page_size = 0, pages = 0, pages_per_seq = 0;
  if (paged) {
    const Tensor& t = *o.block_table;
    ATTNX_CHECK(t.scalar_type() == ScalarType::Int, kOp, ": expected block_table of dtype int32, got ",
                t.scalar_type());
    ATTNX_CHECK(t.dim() == 2 && t.size(0) == N, kOp, ": expected block_table of shape (N, pages_per_seq) = (",
                N, ", pages_per_seq), got ", Sizes{t.sizes()});
    ATTNX_CHECK(t.device() == query.device(), kOp, ": expected block_table on query's device ",
                device_name(query.device()), ", got ", device_name(t.device()));
    pages = key.size(0);
    page_size = key.size(1);
    pages_per_seq = t.size(1);
    ATTNX_CHECK(page_size > 0, kOp, ": expected a page size > 0, got key of shape ", Sizes{key.sizes()});
  }
  detail::check_softcap_and_sinks(kOp, o.softcap, o.sinks, H, query);

  // The values, where reading them needs no device sync. Elsewhere the longest sequences are taken from
  // max_seqlen_q / max_seqlen_k.
  SeqStats stats{o.max_seqlen_q, o.max_seqlen_k, false, false};
  const int64_t total_k = paged ? 0 : key.size(0);
  if (query.device().is_cpu()) {
    stats.max_q = check_offsets(cu_q, "cu_seqlens_q", "query", total_q, true, &stats.q_covered);
    stats.max_k = check_offsets(cu_k, "cu_seqlens_k", "key", total_k, !paged, &stats.k_covered);
    ATTNX_CHECK(stats.max_q <= o.max_seqlen_q && stats.max_k <= o.max_seqlen_k, kOp,
                ": expected max_seqlen_q and max_seqlen_k to be at least the longest sequences (",
                stats.max_q, ", ", stats.max_k, "), got (", o.max_seqlen_q, ", ", o.max_seqlen_k, ")");
    const int32_t* ck = cu_k.const_data_ptr<int32_t>();
    for (int64_t b = 0; b < N; ++b) {
      const int64_t slot = int64_t{ck[b + 1]} - ck[b];
      int64_t used = slot;
      if (o.seqused_k) {
        used = o.seqused_k->const_data_ptr<int32_t>()[b * o.seqused_k->stride(0)];
        ATTNX_CHECK(used >= 0 && used <= slot, kOp, ": expected seqused_k[", b,
                    "] in [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]] = [0, ", slot, "], got ", used);
      }
      if (paged) {
        ATTNX_CHECK(slot <= pages_per_seq * page_size, kOp, ": expected sequence ", b, "'s ", slot,
                    " keys to fit its ", pages_per_seq, " pages of ", page_size, " (block_table's width)");
        const Tensor& t = *o.block_table;
        const int32_t* row = t.const_data_ptr<int32_t>() + b * t.stride(0);
        for (int64_t i = 0; i * page_size < used; ++i) {
          const int32_t page = row[i * t.stride(1)];
          ATTNX_CHECK(page >= 0 && page < pages, kOp, ": expected block_table entries in [0, pages) = [0, ",
                      pages, "), got block_table[", b, ", ", i, "] = ", page);
        }
      }
    }
  }

  // One batch per sequence: the batch strides are 0 and each sequence's rows are offset through stride[2]
  // (AttentionParams::varlen); paged keys step pages through stride[0].
  const IntHeaderOnlyArrayRef qs = query.strides(), ks = key.strides(), vs = value.strides();
  p.batch = N;
  p.heads = H;
  p.q_len = stats.max_q;
  p.kv_len = stats.max_k;
  p.head_dim = D;
  p.v_head_dim = Dv;
  p.kv_heads = Hkv;
  const int64_t q_stride[4] = {0, qs[1], qs[0], qs[2]};
  std::copy(q_stride, q_stride + 4, p.q_stride);
  if (paged) {
    const int64_t k_stride[4] = {ks[0], ks[2], ks[1], ks[3]}, v_stride[4] = {vs[0], vs[2], vs[1], vs[3]};
    std::copy(k_stride, k_stride + 4, p.k_stride);
    std::copy(v_stride, v_stride + 4, p.v_stride);
    p.page_size = page_size;
    p.pages_per_seq = pages_per_seq;
    p.block_table_stride[0] = o.block_table->stride(0);
    p.block_table_stride[1] = o.block_table->stride(1);
    ptr.block_table = o.block_table->const_data_ptr();
  } else {
    const int64_t k_stride[4] = {0, ks[1], ks[0], ks[2]}, v_stride[4] = {0, vs[1], vs[0], vs[2]};
    std::copy(k_stride, k_stride + 4, p.k_stride);
    std::copy(v_stride, v_stride + 4, p.v_stride);
  }
  p.varlen = 1;
  ptr.query = query.const_data_ptr();
  ptr.key = key.const_data_ptr();
  ptr.value = value.const_data_ptr();
  ptr.cu_seqlens_q = cu_q.const_data_ptr();
  ptr.cu_seqlens_k = cu_k.const_data_ptr();
  split_scale(attention_scale(o.scale, D), &p.scale, &p.scale_lo);
  // Bottom-right causal is the window's right side at the diagonal (FlashAttention's rule).
  p.window_left = o.window_left;
  p.window_right = o.is_causal ? 0 : o.window_right;
  if (o.seqused_k) {
    p.key_lengths_kind = kKeyLengthsInt32;
    p.key_lengths_stride = o.seqused_k->stride(0);
    ptr.key_lengths = o.seqused_k->const_data_ptr();
  }
  p.has_sinks = o.sinks ? 1 : 0;
  if (o.softcap) split_scale(*o.softcap, &p.softcap, &p.softcap_lo);
  return stats;
}

void copy_strides3(const Tensor& t, int64_t* out4) {
  // (total, H, E) as (B, H, L, E) with batch stride 0.
  out4[0] = 0;
  out4[1] = t.stride(1);
  out4[2] = t.stride(0);
  out4[3] = t.stride(2);
}

// An output (rows, heads, cols): zeroed unless every row is written by the kernel.
Tensor new_rows(const Tensor& like, int64_t rows, int64_t heads, int64_t cols, bool covered) {
  const int64_t sizes[3] = {rows, heads, cols};
  return covered ? aten::new_empty(like, sizes) : aten::new_zeros(like, sizes);
}

}  // namespace

VarlenAttentionProblem prepare_varlen_attention(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q,
                                                Tensor cu_seqlens_k, VarlenAttentionOptions options) {
  AttentionParams p{};
  AttentionPointers ptr{};
  const SeqStats stats = check_and_describe(query, key, value, cu_seqlens_q, cu_seqlens_k, options, p, ptr);
  const ScalarType dtype = query.scalar_type();
  std::optional<Tensor> sinks_acc = detail::sinks_for_kernels(options.sinks, dtype);
  ptr.sinks = sinks_acc ? sinks_acc->const_data_ptr() : nullptr;
  const int64_t total_q = query.size(0);
  // Rows outside every sequence: out 0 and lse +inf, as a row that sees no key.
  Tensor out = new_rows(query, total_q, p.heads, p.v_head_dim, stats.q_covered);
  const ScalarType acc = attention_acc_dtype(dtype);
  Tensor lse = stats.q_covered ? aten::empty({p.heads, total_q}, acc, query.device())
                               : aten::full({p.heads, total_q}, std::numeric_limits<double>::infinity(), acc,
                                            query.device());
  copy_strides3(out, p.out_stride);
  p.lse_stride[0] = 0;
  p.lse_stride[1] = lse.stride(0);
  p.lse_stride[2] = lse.stride(1);
  ptr.out = out.mutable_data_ptr();
  ptr.lse = lse.mutable_data_ptr();
  return VarlenAttentionProblem{std::move(query),
                                std::move(key),
                                std::move(value),
                                std::move(cu_seqlens_q),
                                std::move(cu_seqlens_k),
                                std::move(options),
                                p,
                                ptr,
                                dtype,
                                std::move(sinks_acc),
                                std::move(out),
                                std::move(lse)};
}

VarlenAttentionBackwardProblem prepare_varlen_attention_backward(Tensor grad_out, Tensor query, Tensor key,
                                                                 Tensor value, Tensor out, Tensor lse,
                                                                 Tensor cu_seqlens_q, Tensor cu_seqlens_k,
                                                                 VarlenAttentionOptions options) {
  ATTNX_CHECK(!options.block_table,
              "attnx::varlen_attention_backward: expected no block_table (a paged KV "
              "cache is inference only), got one");
  AttentionBackwardParams bp{};
  AttentionBackwardPointers ptr{};
  const SeqStats stats =
      check_and_describe(query, key, value, cu_seqlens_q, cu_seqlens_k, options, bp.fwd, ptr.fwd);
  const ScalarType dtype = query.scalar_type(), acc = attention_acc_dtype(dtype);
  const int64_t total_q = query.size(0), total_k = key.size(0), H = bp.fwd.heads, Hkv = bp.fwd.kv_heads;
  const int64_t D = bp.fwd.head_dim, Dv = bp.fwd.v_head_dim;
  const int64_t out_shape[3] = {total_q, H, Dv}, lse_shape[2] = {H, total_q};
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{grad_out, "grad_out"}, {out, "out"}}) {
    ATTNX_CHECK(t.sizes().equals(out_shape), "attnx::varlen_attention_backward: expected ", name,
                " of shape (total_q, H, Dv) = ", Sizes{out_shape}, ", got ", Sizes{t.sizes()});
    ATTNX_CHECK(t.scalar_type() == dtype && t.device() == query.device(),
                "attnx::varlen_attention_backward: expected ", name, " of query's dtype and device");
  }
  ATTNX_CHECK(lse.sizes().equals(lse_shape) && lse.scalar_type() == acc && lse.device() == query.device(),
              "attnx::varlen_attention_backward: expected lse of shape (H, total_q) = ", Sizes{lse_shape},
              " and dtype ", acc, ", got ", Sizes{lse.sizes()}, " ", lse.scalar_type());
  std::optional<Tensor> sinks_acc = detail::sinks_for_kernels(options.sinks, dtype);
  ptr.fwd.sinks = sinks_acc ? sinks_acc->const_data_ptr() : nullptr;
  Tensor grad_query = new_rows(query, total_q, H, D, stats.q_covered);
  Tensor grad_key = new_rows(query, total_k, Hkv, D, stats.k_covered);
  Tensor grad_value = new_rows(query, total_k, Hkv, Dv, stats.k_covered);
  bp.fwd.lse_stride[0] = 0;
  bp.fwd.lse_stride[1] = lse.stride(0);
  bp.fwd.lse_stride[2] = lse.stride(1);
  detail::describe_backward_tensors(bp, ptr, copy_strides3, grad_out, out, lse, grad_query, grad_key,
                                    grad_value);
  return VarlenAttentionBackwardProblem{std::move(grad_out),
                                        std::move(query),
                                        std::move(key),
                                        std::move(value),
                                        std::move(out),
                                        std::move(lse),
                                        std::move(cu_seqlens_q),
                                        std::move(cu_seqlens_k),
                                        std::move(options),
                                        bp,
                                        ptr,
                                        dtype,
                                        std::move(sinks_acc),
                                        std::move(grad_query),
                                        std::move(grad_key),
                                        std::move(grad_value)};
}

VarlenAttentionProblem VarlenAttentionProblem::unbox(StableIValue* stack, uint64_t num_args,
                                                     uint64_t num_outputs) {
  using torch::stable::detail::to;
  VarlenAttentionOptions options = detail::unbox_options<VarlenAttentionOptions>(
      kOp, stack, num_args, num_outputs, /*tensors=*/5, /*trailing=*/0, /*outputs=*/2);
  return prepare_varlen_attention(to<Tensor>(stack[0]), to<Tensor>(stack[1]), to<Tensor>(stack[2]),
                                  to<Tensor>(stack[3]), to<Tensor>(stack[4]), std::move(options));
}

VarlenAttentionBackwardProblem VarlenAttentionBackwardProblem::unbox(StableIValue* stack, uint64_t num_args,
                                                                     uint64_t num_outputs) {
  using torch::stable::detail::to;
  VarlenAttentionOptions options = detail::unbox_options<VarlenAttentionOptions>(
      "attnx::varlen_attention_backward", stack, num_args, num_outputs, /*tensors=*/8, /*trailing=*/0,
      /*outputs=*/4);
  return prepare_varlen_attention_backward(to<Tensor>(stack[0]), to<Tensor>(stack[1]), to<Tensor>(stack[2]),
                                           to<Tensor>(stack[3]), to<Tensor>(stack[4]), to<Tensor>(stack[5]),
                                           to<Tensor>(stack[6]), to<Tensor>(stack[7]), std::move(options));
}

void VarlenAttentionBackwardProblem::box(StableIValue* stack) const {
  using torch::stable::detail::from;
  stack[0] = from(grad_query);
  stack[1] = from(grad_key);
  stack[2] = from(grad_value);
  if (!options.sinks) {
    stack[3] = from(aten::new_empty_output(query));
    return;
  }
  // lse (H, total_q) read transposed, in the shape of the rows' deltas (total_q, H).
  const int64_t lse_sizes[2] = {lse.size(1), lse.size(0)}, lse_strides[2] = {lse.stride(1), lse.stride(0)};
  stack[3] = from(
      detail::sinks_grad(grad_out, out, views::reinterpret(lse, lse_sizes, lse_strides), *options.sinks));
}

}  // namespace attnx
