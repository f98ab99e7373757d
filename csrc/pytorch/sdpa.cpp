// attnx: torch.nn.functional.scaled_dot_product_attention on attnx's CPU kernels, while the SDPA takeover is
// on (python/attnx/sdpa.py is its user-facing side; docs/integrations.md says what it covers).
//
// On CPU tensors SDPA picks its FLASH backend for almost every call (float32/float64/bfloat16/float16, masks,
// grouped KV heads; not dropout) and calls aten::_scaled_dot_product_flash_attention_for_cpu, whose backward
// is aten::_scaled_dot_product_flash_attention_for_cpu_backward. The takeover replaces those two kernels and
// nothing else: PyTorch's selection, derivative formula and meta kernels stay. attnx::_sdpa_takeover(true)
// registers attnx's kernels for both on the CPU key of a torch library made at run time; (false) destroys
// it, which gives PyTorch's kernels back. Kernels registered this way are C++ calls: no Python per call.
//
// Each kernel translates PyTorch's conventions onto attnx::attention's and keeps PyTorch's layouts:
// - is_causal is top-left aligned, as attnx's is; with an attn_mask too, both apply (PyTorch's op adds them).
// - attn_mask is additive (SDPA turns a bool mask into 0 / -inf before the op), 2-D or 4-D, broadcast to
//   (B, H, L, S): read in place as a 4-D view.
// - output is empty_like(query); logsumexp is (B, H, L) in (B, L, H) memory order, float32 (float64 for
//   float64), as PyTorch's meta kernel makes them. A row whose every key is masked out gets output 0 and
//   logsumexp 0, as PyTorch's kernel gives (attnx's own op says +inf there).
// - the gradients are in (B, L, H, D) memory order, key's and value's with their own head count: attnx's
//   layout (common/attention.h).
// A call these kernels do not take (dropout_p > 0, a bool mask, inputs that are not 4-D, empty or whose
// shapes do not fit) goes to PyTorch's own kernel, which computes it or raises PyTorch's error for it: the op
// attnx::_sdpa_for_cpu_fallback (_backward_fallback), whose CPU kernel python/attnx/sdpa.py takes from the
// dispatcher (torch.library.get_kernel) before the takeover starts. So do the bfloat16 (float16) forwards
// that the takeover was told to keep PyTorch's, decoding steps excepted: where PyTorch's kernel runs their
// GEMMs on AMX tiles and attnx's do not (python/attnx/sdpa.py's enable() decides; benchmarks case `sdpa`).
// Their backward is still attnx's, which reads the logsumexp of either forward alike.
#include <torch/csrc/stable/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <utility>

#include "common/aten.h"
#include "common/attention.h"
#include "common/stable.h"
#include "common/views.h"
#include "cpu/attention.h"

namespace attnx {

namespace {

using torch::stable::detail::from;
using torch::stable::detail::to;

// attn_mask as attnx reads a 4-D mask: a 2-D (a, b) mask viewed as (1, 1, a, b).
Tensor mask_4d(const Tensor& mask) {
  if (mask.dim() == 4) return mask;
  const int64_t sizes[4] = {1, 1, mask.size(0), mask.size(1)};
  const int64_t strides[4] = {0, 0, mask.stride(0), mask.stride(1)};
  return views::reinterpret(mask, sizes, strides);
}

bool is_float_dtype(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::BFloat16 ||
         t == ScalarType::Half;
}

// An optional tensor argument as the kernels read it: the autograd engine passes an absent attn_mask as an
// undefined tensor, not as None.
std::optional<Tensor> optional_tensor(StableIValue value) {
  std::optional<Tensor> t = to<std::optional<Tensor>>(value);
  if (t && !t->defined()) t.reset();
  return t;
}

// The 16-bit forwards left to PyTorch's kernel (set with the takeover).
std::atomic<bool> keep_bf16_forward{false}, keep_fp16_forward{false};

// Whether attnx's kernels take this call; PyTorch's kernel gets the others.
bool takes(const Tensor& query, const Tensor& key, const Tensor& value, double dropout_p,
           const std::optional<Tensor>& attn_mask) {
  if (dropout_p != 0.0) return false;
  if (query.dim() != 4 || key.dim() != 4 || value.dim() != 4) return false;
  const ScalarType dtype = query.scalar_type();
  if (!is_float_dtype(dtype) || key.scalar_type() != dtype || value.scalar_type() != dtype) return false;
  const int64_t B = query.size(0), H = query.size(1), L = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2);
  if (B == 0 || H == 0 || L == 0 || S == 0 || D == 0 || value.size(3) == 0) return false;
  if (key.size(0) != B || value.size(0) != B || key.size(3) != D || value.size(1) != Hkv ||
      value.size(2) != S || Hkv == 0 || H % Hkv != 0) {
    return false;
  }
  if (attn_mask) {
    const Tensor& m = *attn_mask;
    if (!is_float_dtype(m.scalar_type()) || (m.dim() != 2 && m.dim() != 4)) return false;
    const int64_t target[4] = {B, H, L, S};
    for (int64_t d = 0; d < m.dim(); ++d) {
      const int64_t n = m.size(d), want = target[4 - m.dim() + d];
      if (n != want && n != 1) return false;
    }
  }
  return true;
}

// logsumexp's rows that see no key: +inf from attnx's kernel, 0 in PyTorch's convention. lse is the dense
// buffer allocated below.
void zero_unseen_rows(const Tensor& lse) {
  const int64_t n = stable::product(lse.sizes());
  const auto fix = [n](auto* x) {
    for (int64_t i = 0; i < n; ++i) {
      if (std::isinf(x[i]) && x[i] > 0) x[i] = 0;
    }
  };
  if (lse.scalar_type() == ScalarType::Double) {
    fix(lse.mutable_data_ptr<double>());
  } else {
    fix(lse.mutable_data_ptr<float>());
  }
}

// aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value,
// float dropout_p=0.0, bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None)
// -> (Tensor output, Tensor logsumexp)
void sdpa_forward(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  stable::check_stack("aten::_scaled_dot_product_flash_attention_for_cpu", num_args, 7, num_outputs, 2);
  Tensor query = to<Tensor>(stack[0]), key = to<Tensor>(stack[1]), value = to<Tensor>(stack[2]);
  const double dropout_p = to<double>(stack[3]);
  const bool is_causal = to<bool>(stack[4]);
  std::optional<Tensor> attn_mask = optional_tensor(stack[5]);
  const std::optional<double> scale = to<std::optional<double>>(stack[6]);
  // Decoding steps (one query row) are bound by reading K and V, not by GEMMs: attnx's kernel, which reads a
  // kv head once for its whole group of query heads, keeps those.
  const ScalarType dtype = query.scalar_type();
  const bool kept = query.dim() == 4 && query.size(2) > 1 &&
                    ((dtype == ScalarType::BFloat16 && keep_bf16_forward) ||
                     (dtype == ScalarType::Half && keep_fp16_forward));
  if (kept || !takes(query, key, value, dropout_p, attn_mask)) {
    auto [out, lse] = stable::call<2>("attnx::_sdpa_for_cpu_fallback", "", query, key, value, dropout_p,
                                      is_causal, attn_mask, scale);
    stack[0] = from(out);
    stack[1] = from(lse);
    return;
  }
  AttentionOptions options;
  if (attn_mask) options.attn_mask = mask_4d(*attn_mask);
  options.is_causal = is_causal;
  options.scale = scale;
  const int64_t B = query.size(0), H = query.size(1), L = query.size(2);
  const int64_t lse_sizes[3] = {B, H, L}, lse_strides[3] = {L * H, 1, H};
  Tensor out = aten::empty_like(query);
  Tensor lse =
      aten::empty_strided(lse_sizes, lse_strides, attention_acc_dtype(query.scalar_type()), query.device());
  AttentionProblem pb = prepare_attention(std::move(query), std::move(key), std::move(value),
                                          std::move(options), std::make_pair(out, lse));
  run_attention_cpu(pb);
  if (attn_mask) zero_unseen_rows(lse);  // without a mask every row sees key 0
  stack[0] = from(out);
  stack[1] = from(lse);
}

// aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, Tensor query, Tensor key,
// Tensor value, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None,
// float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)
void sdpa_backward(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  stable::check_stack("aten::_scaled_dot_product_flash_attention_for_cpu_backward", num_args, 10, num_outputs,
                      3);
  Tensor grad_out = to<Tensor>(stack[0]), query = to<Tensor>(stack[1]), key = to<Tensor>(stack[2]),
         value = to<Tensor>(stack[3]), out = to<Tensor>(stack[4]), lse = to<Tensor>(stack[5]);
  const double dropout_p = to<double>(stack[6]);
  const bool is_causal = to<bool>(stack[7]);
  std::optional<Tensor> attn_mask = optional_tensor(stack[8]);
  const std::optional<double> scale = to<std::optional<double>>(stack[9]);
  if (!takes(query, key, value, dropout_p, attn_mask)) {
    auto grads = stable::call<3>("attnx::_sdpa_for_cpu_backward_fallback", "", grad_out, query, key, value,
                                 out, lse, dropout_p, is_causal, attn_mask, scale);
    for (int i = 0; i < 3; ++i) stack[i] = from(grads[i]);
    return;
  }
  AttentionOptions options;
  if (attn_mask) options.attn_mask = mask_4d(*attn_mask);
  options.is_causal = is_causal;
  options.scale = scale;
  // A row that saw no key has logsumexp 0 here, not +inf: its probabilities exp(-inf - 0) are 0 all the
  // same, so it contributes nothing, as in PyTorch's kernel.
  AttentionBackwardProblem pb = prepare_attention_backward(
      std::move(grad_out), std::move(query), std::move(key), std::move(value), std::move(out), std::move(lse),
      std::move(options), /*grad_attn_mask=*/false);
  run_attention_backward_cpu(pb);
  stack[0] = from(pb.grad_query);
  stack[1] = from(pb.grad_key);
  stack[2] = from(pb.grad_value);
}

// The library that holds the two kernels while the takeover is on. Never destroyed at exit: the dispatcher
// it registers with may be gone by then.
std::mutex takeover_mutex;
torch::stable::detail::StableLibrary* takeover_library = nullptr;

// attnx::_sdpa_takeover: turns the takeover on or off (or, given nothing, leaves it), keeping the 16-bit
// forwards PyTorch's as asked; returns whether it was on.
bool sdpa_takeover(std::optional<bool> turn_on, bool keep_bf16, bool keep_fp16) {
  using torch::stable::detail::StableLibrary;
  std::lock_guard<std::mutex> lock(takeover_mutex);
  const bool was_on = takeover_library != nullptr;
  if (!turn_on) return was_on;
  keep_bf16_forward = keep_bf16;
  keep_fp16_forward = keep_fp16;
  if (*turn_on && !was_on) {
    auto* library = new StableLibrary(StableLibrary::Kind::IMPL, "aten", "CPU", __FILE__, __LINE__);
    library->impl("_scaled_dot_product_flash_attention_for_cpu", &sdpa_forward);
    library->impl("_scaled_dot_product_flash_attention_for_cpu_backward", &sdpa_backward);
    takeover_library = library;
  } else if (!*turn_on && was_on) {
    delete takeover_library;
    takeover_library = nullptr;
  }
  return was_on;
}

}  // namespace

}  // namespace attnx

// Without tensor arguments the dispatcher has no backend key: the CompositeExplicitAutograd kernel is the one
// a call reaches.
STABLE_TORCH_LIBRARY_IMPL(attnx, CompositeExplicitAutograd, m) {
  m.impl("_sdpa_takeover", TORCH_BOX(&attnx::sdpa_takeover));
}
