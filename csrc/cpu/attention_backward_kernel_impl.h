// attnx: attnx::attention_backward's CPU kernel: FlashAttention-2's backward on the forward's tile helpers.
//
// Included once per ISA level, right after cpu/attention_kernel_impl.h and in the same translation unit: it
// uses that file's helpers (masks read in place, packing and transposes, tile GEMMs on gemm.h, vectorised
// exp), which live in the same CPU_CAPABILITY namespace. Defines
// attnx::cpu::CPU_CAPABILITY::attention_backward_kernel.
//
// The math. The probabilities are recomputed tile by tile from the forward's logsumexp and never stored:
//   P = exp(scale Q K^T + bias - lse),  delta = rowsum(dO * O),
//   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dQ = scale dS K,  dK = scale dS^T Q.
// A fully masked row has lse = +inf: its P is exp(-inf) = 0, so it contributes nothing and its dQ is 0.
// Where one key tile holds every key of the head (S <= kBackwardKeysPerTile) and there is neither dropout nor
// a sink, each row of P is whole in the tile pair, and the softmax's backward runs as torch's softmax
// backward does: on P normalised by its row sum, with delta = rowsum(dP * P) of that same P (see
// BackwardPlan:: whole_rows), rather than on exp(S - lse) with delta = rowsum(dO * O). With dropout, Z = keep
// / (1 - p) is regenerated per tile pair from the forward's Philox stream (out is the dropped output, so
// delta = rowsum(dO * O) already is rowsum(dP * Z * P)):
//   dV = (Z * P)^T dO,  dS = P * (Z * dP - delta).
//
// Work item = (b, kv head, a chunk of consecutive key tiles). The item owns dK and dV of its keys: it runs
// the query heads of the kv head's group one after another (grouped KV heads: dK and dV are sums over the
// group, formed here without atomics), each over every key tile of the chunk and every query tile that sees
// it, accumulating dK and dV in (chunk keys, D) scratch written once at the end. Every key tile also adds to
// dQ of its head. With one chunk per kv head (the default, when the items keep the threads busy) the item
// accumulates a head's dQ in per-thread scratch and writes it when the head is done; with several (few kv
// heads) each item accumulates into its own slot of a (B*H*chunks, D, L) buffer and a second pass sums the
// slots. A float attn_mask's gradient is dS summed over the dims the mask broadcasts along; an item then
// covers every batch (kv head) whose dS adds into the same elements, so that it alone writes them. No two
// threads ever write the same memory, so there are no atomics and results do not depend on scheduling.
// Key tiles and query tiles outside each other's key range (is_causal, key lengths, the window) are skipped.
// Packed sequences (AttentionParams::varlen) are batches of their own lengths, their rows offset by the
// sequence's first query and key rows (seq_range): an item owns one sequence's keys, every key the sequence
// stores gets its gradient (0 past seqused_k), and rows past a shorter sequence are never touched.
//
// Orientation. Tiles are key-major: S^T (bk, bq) = K (bk, D) @ (scale Q)^T (D, bq). P^T and dS^T are then the
// A operands of dV += P^T dO and dK += dS^T Q as they are, and dQ^T (D, bq) += K^T (D, bk) @ dS^T (bk, bq)
// takes dS^T as its B operand: all five GEMMs run on gemm.h's row-major C (+)= A B (which takes no
// transposes) without transposing anything per tile pair. The transposes are paid once per item instead:
// (scale Q)^T and dO^T of the head are packed (D, L) and (Dv, L), and dQ is accumulated transposed. The
// softmax's per-query quantities (lse, delta, a mask row) run along a tile row, so the vectorised pass loads
// them as vectors.
//
// Memory beyond the inputs and the gradients: per thread, (D + Dv) x L packed queries and output gradients,
// D x L of dQ^T (plus L x (D + Dv) when Q or dO cannot be read in place: another dtype, or rows that are not
// contiguous) and (bk, bq) tiles; O(B*S/bk + mask tiles) skip flags; with several chunks per head, the
// (B*H*chunks, D, L) dQ slots, chunks being chosen only when B*H < 2 * threads.

namespace attnx::cpu {
namespace CPU_CAPABILITY {
namespace {

// Keys and queries per tile pair. 128 x 128 keeps the two (bk, bq) tiles (P^T and dS^T, 64 KiB each in fp32)
// and the key tile in L2 next to the packed queries they are multiplied with.
constexpr int64_t kBackwardKeysPerTile = 128;
constexpr int64_t kBackwardQueriesPerTile = 128;

// A leading dimension for rows of n accumulators: whole 64-byte lines, an odd number of them, so that the
// rows of a tile do not all map onto the same cache sets (as the forward's score tile).
inline int64_t padded_ld(int64_t n, size_t acc_size) {
  const int64_t line = 64 / static_cast<int64_t>(acc_size);
  int64_t lines = round_up(std::max<int64_t>(n, 1), line) / line;
  if (lines % 2 == 0) ++lines;
  return lines * line;
}

// True when a (rows, cols) block of scalar_t with these strides can be a GEMM operand as it is: already in
// the accumulator type, contiguous rows that do not overlap, a leading dimension within int range
// (b_operand's rule).
template <typename scalar_t, typename acc_t>
bool operand_in_place(int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols) {
  if constexpr (!std::is_same_v<scalar_t, acc_t>) {
    return false;
  } else {
    const int64_t dense_ld = std::max<int64_t>(cols, 1);
    const bool rows_ok =
        rows <= 1 || (row_stride >= dense_ld && row_stride <= std::numeric_limits<int>::max());
    return (cols <= 1 || col_stride == 1) && rows_ok;
  }
}

// s[j] and dp[j] zeroed for j < lo and hi <= j < n: the queries of a tile row that do not see its key.
template <typename acc_t>
void zero_outside(acc_t* s, acc_t* dp, int64_t lo, int64_t hi, int64_t n) {
  std::fill_n(s, lo, acc_t(0));
  std::fill_n(dp, lo, acc_t(0));
  std::fill(s + hi, s + n, acc_t(0));
  std::fill(dp + hi, dp + n, acc_t(0));
}

// One key row of a (bk, bq) tile pair, in place and vectorised: s[j], a scaled score, becomes
// p = exp(s[j] + bias - lse[j]) and dp[j] becomes dS = p * (dp[j] - delta[j]), for lo <= j < hi; both are 0
// for the other j < n (queries that do not see this key: is_causal, key lengths, the window). The bias is the
// mask row `bias` (key padding included) when not null, else the scalar row_bias (key padding plus a mask
// that is the same for every query; 0 without masks).
template <typename acc_t>
void softmax_backward_row(acc_t* s, acc_t* dp, const acc_t* bias, acc_t row_bias, const acc_t* lse,
                          const acc_t* delta, int64_t lo, int64_t hi, int64_t n) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  zero_outside(s, dp, lo, hi, n);
  n = hi;
  int64_t j = lo;
  if (bias) {
    for (; j + W <= n; j += W) {
      const V p = vexp(V::loadu(s + j) + V::loadu(bias + j) - V::loadu(lse + j));
      p.store(s + j);
      (p * (V::loadu(dp + j) - V::loadu(delta + j))).store(dp + j);
    }
  } else {
    const V vb(row_bias);
    for (; j + W <= n; j += W) {
      const V p = vexp(V::loadu(s + j) + vb - V::loadu(lse + j));
      p.store(s + j);
      (p * (V::loadu(dp + j) - V::loadu(delta + j))).store(dp + j);
    }
  }
  for (; j < n; ++j) {
    const acc_t p = std::exp(s[j] + (bias ? bias[j] : row_bias) - lse[j]);
    s[j] = p;
    dp[j] = p * (dp[j] - delta[j]);
  }
}

// softmax_backward_row over a whole (nk, nq) tile pair that holds every key its queries see (BackwardPlan::
// whole_rows), in place on the key-major tiles s (S^T, scaled scores, leading dimension ld) and dp (dP^T):
// with p = exp(s + bias - lse) over the keys a query sees ([lo[r], hi[r]) of key row r; s and dp are 0
// elsewhere), s becomes P = p / rowsum(p), which dV sees, and dp becomes dS = P * (dp - delta) with delta =
// rowsum(dP * P), both sums over the query's keys (P = 0 for a query that sees none). The bias of row r is
// the mask row bias + r * ld when bias is not null, else row_bias[r] (0 when that is null). By blocks of one
// vector of queries, each through both passes while its columns are in cache, the block's sums in registers;
// a block shorter than a vector in scalars.
template <typename acc_t>
void softmax_backward_whole_rows(acc_t* s, acc_t* dp, int64_t ld, const acc_t* bias, const acc_t* row_bias,
                                 const acc_t* lse, const int32_t* lo, const int32_t* hi, int64_t nk,
                                 int64_t nq) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  for (int64_t c = 0; c < nq; c += W) {
    const int64_t w = std::min(W, nq - c);
    const bool full = w == W;
    // The block's columns of key row r, the queries [j0, j1) of them that see it zeroed around.
    const auto columns = [&](int64_t r, int64_t& j0, int64_t& j1) {
      j0 = std::clamp<int64_t>(lo[r] - c, 0, w);
      j1 = std::clamp<int64_t>(hi[r] - c, j0, w);
    };
    // rowsum(p) and rowsum(p * dp) of the block's queries: in vector lanes over the key rows seen by the
    // whole block (two pairs of sums, for two rows at a time), in scalars over the others (a block's edge
    // under is_causal or a window, a block shorter than a vector).
    V sum0(acc_t(0)), dot0(acc_t(0)), sum1(acc_t(0)), dot1(acc_t(0));
    acc_t sum[W], dot[W];
    std::fill_n(sum, w, acc_t(0));
    std::fill_n(dot, w, acc_t(0));
    const V vlse = full ? V::loadu(lse + c) : V(acc_t(0));
    const auto covers = [&](int64_t r) { return full && lo[r] <= c && c + W <= hi[r]; };
    const auto vector_row = [&](int64_t r, V& vsum, V& vdot) {
      acc_t* sr = s + r * ld + c;
      const V vb = bias ? V::loadu(bias + r * ld + c) : V(row_bias ? row_bias[r] : acc_t(0));
      const V p = vexp(V::loadu(sr) + vb - vlse);
      p.store(sr);
      vsum = vsum + p;
      vdot = fmadd(p, V::loadu(dp + r * ld + c), vdot);
    };
    int64_t r = 0;
    for (; r + 2 <= nk && covers(r) && covers(r + 1); r += 2) {
      vector_row(r, sum0, dot0);
      vector_row(r + 1, sum1, dot1);
    }
    for (; r < nk; ++r) {
      if (covers(r)) {
        vector_row(r, sum0, dot0);
        continue;
      }
      acc_t *sr = s + r * ld + c, *dr = dp + r * ld + c;
      int64_t j0, j1;
      columns(r, j0, j1);
      zero_outside(sr, dr, j0, j1, w);
      const acc_t* br = bias ? bias + r * ld + c : nullptr;
      const acc_t rb = row_bias ? row_bias[r] : acc_t(0);
      for (int64_t j = j0; j < j1; ++j) {
        const acc_t p = std::exp(sr[j] + (br ? br[j] : rb) - lse[c + j]);
        sr[j] = p;
        sum[j] += p;
        dot[j] += p * dr[j];
      }
    }
    // 1 / rowsum(p) and delta = rowsum(p * dp) / rowsum(p).
    acc_t inv[W], delta[W];
    if (full) {
      (sum0 + sum1).store(inv);
      (dot0 + dot1).store(delta);
    }
    for (int64_t j = 0; j < w; ++j) {
      const acc_t total = full ? inv[j] + sum[j] : sum[j];
      inv[j] = total > acc_t(0) ? acc_t(1) / total : acc_t(0);
      delta[j] = (full ? delta[j] + dot[j] : dot[j]) * inv[j];
    }
    r = 0;
    if (full) {
      const V vinv = V::loadu(inv), vdelta = V::loadu(delta);
      for (; r < nk && covers(r); ++r) {
        acc_t *sr = s + r * ld + c, *dr = dp + r * ld + c;
        const V p = V::loadu(sr) * vinv;
        p.store(sr);
        (p * (V::loadu(dr) - vdelta)).store(dr);
      }
    }
    for (; r < nk; ++r) {
      acc_t *sr = s + r * ld + c, *dr = dp + r * ld + c;
      int64_t j0, j1;
      columns(r, j0, j1);
      for (int64_t j = j0; j < j1; ++j) {
        const acc_t p = sr[j] * inv[j];
        sr[j] = p;
        dr[j] = p * (dr[j] - delta[j]);
      }
    }
  }
}

// softmax_backward_row with dropout: z[j] is the element's dropout factor (0, or 1 / (1 - p) when kept);
// s[j] becomes the dropped probability z p, which dV sees, and dp[j] becomes dS = p * (z * dp[j] - delta[j]).
template <typename acc_t>
void softmax_backward_row_dropout(acc_t* s, acc_t* dp, const acc_t* bias, acc_t row_bias, const acc_t* lse,
                                  const acc_t* delta, const acc_t* z, int64_t lo, int64_t hi, int64_t n) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  zero_outside(s, dp, lo, hi, n);
  n = hi;
  const V vb(row_bias);
  int64_t j = lo;
  for (; j + W <= n; j += W) {
    const V vbias = bias ? V::loadu(bias + j) : vb;
    const V p = vexp(V::loadu(s + j) + vbias - V::loadu(lse + j));
    const V vz = V::loadu(z + j);
    (p * vz).store(s + j);
    (p * (vz * V::loadu(dp + j) - V::loadu(delta + j))).store(dp + j);
  }
  for (; j < n; ++j) {
    const acc_t p = std::exp(s[j] + (bias ? bias[j] : row_bias) - lse[j]);
    s[j] = p * z[j];
    dp[j] = p * (z[j] * dp[j] - delta[j]);
  }
}

// Soft-capping on a row of scaled scores: s[j] = cap * tanh(s[j] / cap), and deriv[j] = 1 - tanh^2, the
// factor that turns dS of the capped score into dS of the scaled one.
template <typename acc_t>
void softcap_backward_row(acc_t* s, acc_t* deriv, int64_t n, acc_t cap) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const V vcap(cap), one(acc_t(1));
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const V t = vtanh(V::loadu(s + j) / vcap);
    (t * vcap).store(s + j);
    (one - t * t).store(deriv + j);
  }
  for (; j < n; ++j) {
    const acc_t t = std::tanh(s[j] / cap);
    s[j] = cap * t;
    deriv[j] = acc_t(1) - t * t;
  }
}

// dst[j] *= f[j] for j < n.
template <typename acc_t>
void mul_row(acc_t* dst, const acc_t* f, int64_t n) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  int64_t j = 0;
  for (; j + W <= n; j += W) (V::loadu(dst + j) * V::loadu(f + j)).store(dst + j);
  for (; j < n; ++j) dst[j] *= f[j];
}

template <typename acc_t>
void add_row(acc_t* dst, const acc_t* src, int64_t n) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  int64_t j = 0;
  for (; j + W <= n; j += W) (V::loadu(dst + j) + V::loadu(src + j)).store(dst + j);
  for (; j < n; ++j) dst[j] += src[j];
}

// ---------------------------------------------------------------------------------------------------------------
// The tiling plan and the per-thread scratch.

struct BackwardPlan {
  int64_t bq;       // queries per tile
  int64_t bk;       // keys per tile
  int64_t q_tiles;  // ceil(L / bq)
  int64_t k_tiles;  // ceil(S / bk)
  int64_t group;    // query heads per kv head, H / Hkv
  // Work items are (batch slot, kv-head slot, chunk). A slot is one batch (kv head), or all of them when the
  // mask's gradient is summed over the batch (heads): the item that owns a gradient element of a broadcast
  // mask then runs every (b, h) that adds into it, so no two threads write one element.
  int64_t batch_slots;  // B, or 1
  int64_t head_slots;   // Hkv, or 1
  int64_t chunks;       // work items per (batch slot, kv-head slot), each a run of chunk_tiles key tiles
  int64_t chunk_tiles;  // key tiles per chunk
  int64_t ld_q;         // leading dimension of the whole-head transposed buffers (Q^T, dO^T, dQ^T)
  int64_t ld_t;         // leading dimension of the (bk, bq) tiles
  int64_t ld_k;         // leading dimension of the transposed key tile and of mask rows
  int64_t bh_m;         // attn_mask's distinct (b, h) pairs: B*H, H, B or 1 as its strides broadcast
  int64_t heads_m;      // attn_mask's distinct heads: H, or 1 when broadcast over heads
  bool mask_rows;       // attn_mask differs between queries: each tile pair builds a bias tile
  bool bias_tiles;      // some tile pairs build a bias tile: mask_rows, or a block map's PARTIAL blocks
  bool mask_grad;       // attn_mask's gradient is summed into AttentionBackwardPointers::grad_attn_mask
  // One key tile holds every key (k_tiles == 1), without dropout or sinks: each tile pair holds whole rows of
  // P, so the softmax backward normalises them and takes delta = rowsum(dP * P) from them
  // (softmax_backward_whole_rows), as torch's softmax backward does, rather than using exp(S - lse) and
  // rowsum(dO * O). Those rest on the rounded lse and out: every P of a row carries lse's rounding, and
  // delta, from the forward's out, is not that of this P, so a row's dS does not sum to 0 to rounding, and
  // the gradients that such sums cancel in (of a key bias: a shift shared by a row's scores changes nothing)
  // measured 1.2x torch's float32 error in geometric mean at nn.MultiheadAttention's smallest shapes
  // (tests/test_mha_accuracy.py). It costs a second pass over the pair's (nk, nq) tiles and spares the
  // per-query rowsum(dO * O).
  bool whole_rows;
  bool q_in_place;   // Q's rows are read in place as GEMM operands (else packed once per item)
  bool do_in_place;  // likewise for dO
};

BackwardPlan make_backward_plan(const AttentionBackwardParams& bp, const int64_t* grad_mask_size,
                                size_t acc_size, bool q_in_place, bool do_in_place) {
  const AttentionParams& p = bp.fwd;
  BackwardPlan plan{};
  const int64_t B = p.batch, H = p.heads, L = p.q_len, S = p.kv_len;
  tile_sizes(p, kBackwardQueriesPerTile, kBackwardKeysPerTile, &plan.bq, &plan.bk);
  plan.q_tiles = (L + plan.bq - 1) / plan.bq;
  plan.k_tiles = (S + plan.bk - 1) / plan.bk;
  plan.group = p.kv_heads > 0 ? H / p.kv_heads : 1;
  plan.mask_grad = grad_mask_size != nullptr;
  plan.batch_slots = plan.mask_grad && grad_mask_size[0] == 1 ? 1 : B;
  plan.head_slots = plan.mask_grad && grad_mask_size[1] == 1 ? 1 : p.kv_heads;
  // One item per slot pair unless that leaves threads idle: then split the keys of each, so that there are
  // about two items per thread (keys are what an item owns; queries are shared through the dQ slots). A mask
  // gradient summed over keys (an (..., L, 1) mask) is written by every key tile: one chunk then.
  const int64_t threads = num_threads();
  const int64_t slots = plan.batch_slots * plan.head_slots;
  const bool keys_summed = plan.mask_grad && grad_mask_size[3] == 1 && S > 1;
  plan.chunks = 1;
  if (slots > 0 && slots < 2 * threads && plan.k_tiles > 1 && !keys_summed) {
    plan.chunks = std::min(plan.k_tiles, (2 * threads + slots - 1) / slots);
  }
  plan.chunk_tiles = plan.k_tiles == 0 ? 0 : (plan.k_tiles + plan.chunks - 1) / plan.chunks;
  if (plan.chunk_tiles > 0) plan.chunks = (plan.k_tiles + plan.chunk_tiles - 1) / plan.chunk_tiles;
  plan.ld_q = padded_ld(L, acc_size);
  plan.ld_t = padded_ld(plan.bq, acc_size);
  plan.ld_k = padded_ld(plan.bk, acc_size);
  plan.heads_m = p.attn_mask_stride[1] == 0 ? 1 : H;
  plan.bh_m = (p.attn_mask_stride[0] == 0 ? 1 : B) * plan.heads_m;
  plan.mask_rows = p.attn_mask_kind != kMaskNone && p.attn_mask_stride[2] != 0;
  plan.bias_tiles = plan.mask_rows || p.has_block_map;
  plan.whole_rows = plan.k_tiles == 1 && plan.bk <= kBackwardKeysPerTile && !p.dropout && !p.has_sinks;
  plan.q_in_place = q_in_place;
  plan.do_in_place = do_in_place;
  return plan;
}

template <typename acc_t>
struct BackwardScratch {
  AlignedBuffer<acc_t> storage;
  // Whole head (rows are queries l < L).
  acc_t* qt;     // (D, ld_q) (scale Q)^T
  acc_t* dot;    // (Dv, ld_q) dO^T
  acc_t* q;      // (L, D) Q, when it is not read in place
  acc_t* dout;   // (L, Dv) dO, when it is not read in place
  acc_t* lse;    // (L,)
  acc_t* delta;  // (L,) rowsum(dO * O); not with whole_rows
  acc_t* dqt;    // (D, ld_q) dQ^T / scale, with one chunk per head
  // One key tile, one tile pair.
  acc_t* k;          // (bk, D) key tile converted, when it cannot be read in place
  acc_t* kt;         // (D, ld_k) K^T
  acc_t* v;          // (bk, Dv) value tile converted, when it cannot be read in place
  acc_t* s;          // (bk, ld_t) S^T, then P^T
  acc_t* dp;         // (bk, ld_t) dP^T, then dS^T
  acc_t* bias;       // (bk, ld_t) attn_mask (+ key padding, + a PARTIAL block's -inf) of the pair,
                     // transposed; with bias_tiles only
  acc_t* rows;       // (bq, ld_k) the same, one query per row, before the transpose; with bias_tiles, and
                     // with mask_grad for dS transposed back to query rows
  acc_t* key_bias;   // (bk,) key padding, plus attn_mask when it is the same for every query
  acc_t* dk;         // (chunk_tiles * bk, D) dK / scale of the item's keys, summed over the kv head's group
  acc_t* dv;         // (chunk_tiles * bk, Dv) dV of the item's keys, likewise
  acc_t* deriv;      // (bk, ld_t) the soft-cap's derivative 1 - tanh^2 of the pair; with softcap only
  acc_t* drop_rows;  // (bq, ld_k) dropout factors of a tile pair, one query per row; with dropout only
  acc_t* drop;       // (bk, ld_t) the same, transposed to the tile's key-major layout; with dropout only
  acc_t* tmp;        // (bq, max(D, Dv)) a query tile being packed or written
  // Operands over the whole head: row l at ptr + l * ld.
  Operand<acc_t> q_op{};
  Operand<acc_t> do_op{};
  // With bfloat16 pairs (AttentionBackwardCpu::kPairs), the five products' operands instead of qt, dot, q,
  // dout, k, kt and v (which are then empty); a query tile's row pairs start at tile * bq2 rows.
  AlignedBuffer<uint32_t> pair_storage;
  uint32_t* qtp = nullptr;   // (D2, ld_q) Q^T, pairs along D, unscaled (the score product scales)
  uint32_t* dotp = nullptr;  // (Dv2, ld_q) dO^T, pairs along Dv
  uint32_t* qrp = nullptr;   // (q_tiles * bq2, D) Q's row pairs, tile by tile
  uint32_t* dorp = nullptr;  // (q_tiles * bq2, Dv) dO's row pairs, tile by tile
  uint32_t* kp = nullptr;    // (bk, D2) the key tile's rows
  uint32_t* krp = nullptr;   // (bk2, D) its row pairs
  uint32_t* ktp = nullptr;   // (D, ld_kp) those transposed: K^T, pairs along keys
  uint32_t* vp = nullptr;    // (bk, Dv2) the value tile's rows
  uint32_t* pp = nullptr;    // (bk, ld_tp) P^T rounded, pairs along queries
  uint32_t* dsp = nullptr;   // (bk, ld_tp) dS^T likewise
  uint32_t* dsrp = nullptr;  // (bk2, ld_t) dS^T rounded, pairs along keys
  uint32_t* tmpp = nullptr;  // (bq, max(D2, Dv2)) a query tile's rows, before the transpose
  int64_t bq2 = 0, ld_tp = 0, ld_kp = 0;

  BackwardScratch(const AttentionParams& p, const BackwardPlan& plan, bool pairs) {
    const int64_t L = p.q_len, D = p.head_dim, Dv = p.v_head_dim, bq = plan.bq, bk = plan.bk;
    const int64_t line = kLine<acc_t>;
    const int64_t chunk_keys = std::max<int64_t>(plan.chunk_tiles, 1) * bk;
    // The float operands that pairs replace.
    const int64_t d_float = pairs ? 0 : D, dv_float = pairs ? 0 : Dv;
    constexpr int kRegions = 20;
    const int64_t sizes[kRegions] = {
        d_float * plan.ld_q,
        dv_float * plan.ld_q,
        plan.q_in_place || pairs ? 0 : L * D,
        plan.do_in_place || pairs ? 0 : L * Dv,
        L,
        L,
        plan.chunks == 1 ? D * plan.ld_q : 0,
        bk * d_float,
        d_float * plan.ld_k,
        bk * dv_float,
        bk * plan.ld_t,
        bk * plan.ld_t,
        plan.bias_tiles ? bk * plan.ld_t : 0,
        plan.bias_tiles || plan.mask_grad ? bq * plan.ld_k : 0,
        bk,
        chunk_keys * D,
        chunk_keys * Dv,
        p.dropout ? bq * plan.ld_k : 0,
        p.dropout ? bk * plan.ld_t : 0,
        p.softcap > 0.0f ? bk * plan.ld_t : 0,
    };
    const int64_t tmp_size = bq * std::max(D, Dv);
    int64_t total = round_up(tmp_size, line);
    for (int64_t n : sizes) total += round_up(n, line);
    storage = AlignedBuffer<acc_t>(total);
    acc_t* next = storage.data();
    acc_t* regions[kRegions];
    for (int i = 0; i < kRegions; ++i) {
      regions[i] = next;
      next += round_up(sizes[i], line);
    }
    qt = regions[0], dot = regions[1], q = regions[2], dout = regions[3], lse = regions[4],
    delta = regions[5];
    dqt = regions[6], k = regions[7], kt = regions[8], v = regions[9], s = regions[10], dp = regions[11];
    bias = regions[12], rows = regions[13], key_bias = regions[14], dk = regions[15], dv = regions[16];
    drop_rows = regions[17], drop = regions[18], deriv = regions[19];
    tmp = next;
    if (!pairs) return;
    const int64_t D2 = (D + 1) / 2, Dv2 = (Dv + 1) / 2, bk2 = (bk + 1) / 2;
    bq2 = (bq + 1) / 2;
    ld_tp = round_up(bq2, 16);
    ld_kp = round_up(bk2, 16);
    constexpr int kPairRegions = 12;
    const int64_t pair_sizes[kPairRegions] = {D2 * plan.ld_q,
                                              Dv2 * plan.ld_q,
                                              plan.q_tiles * bq2 * D,
                                              plan.q_tiles * bq2 * Dv,
                                              bk * D2,
                                              bk2 * D,
                                              D * ld_kp,
                                              bk * Dv2,
                                              bk * ld_tp,
                                              bk * ld_tp,
                                              bk2 * plan.ld_t,
                                              bq * std::max(D2, Dv2)};
    int64_t pair_total = 0;
    for (int64_t n : pair_sizes) pair_total += round_up(n, 16);
    pair_storage = AlignedBuffer<uint32_t>(pair_total);
    uint32_t* at = pair_storage.data();
    uint32_t** pair_regions[kPairRegions] = {&qtp, &dotp, &qrp, &dorp, &kp,   &krp,
                                             &ktp, &vp,   &pp,  &dsp,  &dsrp, &tmpp};
    for (int i = 0; i < kPairRegions; ++i) {
      *pair_regions[i] = at;
      at += round_up(pair_sizes[i], 16);
    }
  }
};

// ---------------------------------------------------------------------------------------------------------------
// The kernel.

template <typename scalar_t>
class AttentionBackwardCpu {
 public:
  using acc_t = typename AccType<scalar_t>::type;
  // bfloat16 inputs multiplied as pairs where the TU has the products (dot16.h), as in the forward: Q, K, V
  // and dO keep their bits; P and dS are rounded to bfloat16 for the products they enter (FlashAttention's
  // rule); scores, dP and the gradients' accumulators are float32.
  static constexpr bool kPairs = kDotBf16 && std::is_same_v<scalar_t, torch::headeronly::BFloat16>;
  using op_t = std::conditional_t<kPairs, uint32_t, acc_t>;  // the key and value tiles' operand elements

  AttentionBackwardCpu(const AttentionBackwardParams& bp, const AttentionBackwardPointers& d)
      : bp_(bp),
        p_(bp.fwd),
        d_(d),
        plan_(make_backward_plan(
            bp, d.grad_attn_mask ? bp.grad_attn_mask_size : nullptr, sizeof(acc_t),
            operand_in_place<scalar_t, acc_t>(p_.q_stride[2], p_.q_stride[3], p_.q_len, p_.head_dim),
            operand_in_place<scalar_t, acc_t>(bp.grad_out_stride[2], bp.grad_out_stride[3], p_.q_len,
                                              p_.v_head_dim))),
        scale_(split_value<acc_t>(p_.scale, p_.scale_lo)),
        dropout_scale_(split_value<acc_t>(p_.dropout_scale, p_.dropout_scale_lo)),
        softcap_(split_value<acc_t>(p_.softcap, p_.softcap_lo)) {}

  void run() {
    const int64_t BH = p_.batch * p_.heads, D = p_.head_dim;
    if (BH == 0) return;
    skip_ = TileSkipFlags<acc_t>(p_, d_.fwd.attn_mask, d_.fwd.key_padding_mask, d_.fwd.block_map,
                                 d_.fwd.block_bits, plan_);
    const int64_t chunks = plan_.chunks, slots_n = plan_.batch_slots * plan_.head_slots;
    const int64_t items = slots_n * chunks;
    const int64_t slot = D * plan_.ld_q;
    if (chunks > 1) {
      slots_storage_ = AlignedBuffer<acc_t>(BH * chunks * slot);
    }
    acc_t* slots = chunks > 1 ? slots_storage_.data() : nullptr;

    // Items are handed out one at a time from a shared counter, chunk by chunk: under is_causal the first key
    // chunk of a head sees the most queries, so the heavy items start first and the short ones fill in.
    std::atomic<int64_t> next{0};
    const int64_t threads = std::min<int64_t>(num_threads(), items);
    parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      BackwardScratch<acc_t> ws(p_, plan_, kPairs);
      for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
        const int64_t c = i / slots_n, sl = i % slots_n;
        const int64_t bs = sl / plan_.head_slots, hs = sl % plan_.head_slots;
        // A slot covers one batch (kv head), or all of them (see BackwardPlan).
        const int64_t b_end = plan_.batch_slots == p_.batch ? bs + 1 : p_.batch;
        const int64_t hk_end = plan_.head_slots == p_.kv_heads ? hs + 1 : p_.kv_heads;
        for (int64_t b = bs; b < b_end; ++b) {
          for (int64_t hk = hs; hk < hk_end; ++hk) {
            run_item(b, hk, c, slots, ws);
          }
        }
      }
    });
    if (chunks > 1) reduce_dq_slots(slots);
  }

 private:
  // Key tiles [c * chunk_tiles, ...) of kv head (b, hk): their dK and dV, summed over the query heads of the
  // kv head's group, which run one after another (no atomics: the item owns these keys' gradients), and each
  // head's contribution to its dQ^T (/ scale): in ws.dqt, written at the end of the head, with one chunk per
  // head; else in the head's slot for this chunk (zeroed here), summed by reduce_dq_slots.
  void run_item(int64_t b, int64_t hk, int64_t c, acc_t* slots, BackwardScratch<acc_t>& ws) {
    // One batch, or one packed sequence with varlen (its rows offset by seq.q_begin and seq.k_begin).
    const SeqRange seq = seq_range(p_, d_.fwd, b);
    const int64_t L = seq.q_len, D = p_.head_dim, Dv = p_.v_head_dim, bk = plan_.bk;
    const int64_t kt_begin = c * plan_.chunk_tiles;
    const int64_t kt_end = std::min(plan_.k_tiles, kt_begin + plan_.chunk_tiles);
    const int64_t kv_len_b = seq.kv_len;
    const int64_t k_first = kt_begin * bk, k_last = std::min(kt_end * bk, kv_len_b) - 1;
    std::fill_n(ws.dk, (kt_end - kt_begin) * bk * D, acc_t(0));
    std::fill_n(ws.dv, (kt_end - kt_begin) * bk * Dv, acc_t(0));
    // Queries before the first that sees one of the chunk's keys see none of them.
    const int64_t q_first =
        k_first <= k_last ? range_query_begin(k_first, L, kv_len_b, p_.window_right, p_.is_causal) : L;
    const int64_t r0 = std::min(L, q_first / plan_.bq * plan_.bq);
    const int64_t slot = D * plan_.ld_q;
    for (int64_t h = hk * plan_.group; h < (hk + 1) * plan_.group; ++h) {
      acc_t* dqt = plan_.chunks == 1 ? ws.dqt : slots + ((b * p_.heads + h) * plan_.chunks + c) * slot;
      for (int64_t d = 0; d < D; ++d) std::fill_n(dqt + d * plan_.ld_q, L, acc_t(0));
      if (r0 < L) {
        pack_head(b, h, r0, seq, ws);
        for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
          run_key_tile(b, h, kt, seq, dqt, ws.dk + (kt - kt_begin) * bk * D,
                       ws.dv + (kt - kt_begin) * bk * Dv, ws);
        }
      }
      if (plan_.chunks == 1) {
        for (int64_t qt = 0; qt * plan_.bq < L; ++qt) write_dq_tile(b, h, qt, seq, dqt, ws.tmp);
      }
    }
    // Every key the batch (sequence) stores gets its gradients, 0 past S_b; a shorter sequence's tiles end
    // at its own keys.
    for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
      const int64_t k0 = kt * bk, nk = std::min(bk, seq.k_slot - k0);
      if (nk <= 0) break;
      write_key_tile(b, hk, seq.k_begin + k0, nk, ws.dk + (kt - kt_begin) * bk * D,
                     ws.dv + (kt - kt_begin) * bk * Dv);
    }
  }

  // Queries [r0, L) of head (b, h) into the scratch: (scale Q)^T and dO^T transposed, Q and dO as row-major
  // operands (in place when possible), lse and (but with whole_rows) delta = rowsum(dO * O).
  void pack_head(int64_t b, int64_t h, int64_t r0, const SeqRange& seq, BackwardScratch<acc_t>& ws) {
    const int64_t L = seq.q_len, D = p_.head_dim, Dv = p_.v_head_dim, ld_q = plan_.ld_q, l0 = seq.q_begin;
    const int64_t *qs = p_.q_stride, *gs = bp_.grad_out_stride, *os = p_.out_stride, *ls = p_.lse_stride;
    const auto* q = static_cast<const scalar_t*>(d_.fwd.query) + b * qs[0] + h * qs[1] + l0 * qs[2];
    const auto* dout = static_cast<const scalar_t*>(d_.grad_out) + b * gs[0] + h * gs[1] + l0 * gs[2];
    const auto* out = static_cast<const scalar_t*>(d_.fwd.out) + b * os[0] + h * os[1] + l0 * os[2];
    const auto* lse = static_cast<const acc_t*>(d_.fwd.lse) + b * ls[0] + h * ls[1] + l0 * ls[2];

    if constexpr (kPairs) {
      // Per query tile (r0 starts one): Q and dO transposed as pairs along D, and their row pairs.
      const int64_t D2 = (D + 1) / 2, Dv2 = (Dv + 1) / 2;
      for (int64_t l0 = r0; l0 < L; l0 += plan_.bq) {
        const int64_t nl = std::min(plan_.bq, L - l0), row_pairs = l0 / plan_.bq * ws.bq2;
        if (D > 0) {
          pack_pairs(q + l0 * qs[2], qs[2], qs[3], nl, D, ws.tmpp, D2);
          transpose(ws.tmpp, D2, ws.qtp + l0, ld_q, nl, D2);
          pack_row_pairs(q + l0 * qs[2], qs[2], qs[3], nl, D, ws.qrp + row_pairs * D, D);
        }
        if (Dv > 0) {
          pack_pairs(dout + l0 * gs[2], gs[2], gs[3], nl, Dv, ws.tmpp, Dv2);
          transpose(ws.tmpp, Dv2, ws.dotp + l0, ld_q, nl, Dv2);
          pack_row_pairs(dout + l0 * gs[2], gs[2], gs[3], nl, Dv, ws.dorp + row_pairs * Dv, Dv);
        }
      }
    } else {
      for (int64_t l0 = r0; l0 < L; l0 += plan_.bq) {
        const int64_t nl = std::min(plan_.bq, L - l0);
        if (D > 0) transpose_keys(q + l0 * qs[2], qs[2], qs[3], nl, D, ws.tmp, ws.qt + l0, ld_q);
        if (Dv > 0) transpose_keys(dout + l0 * gs[2], gs[2], gs[3], nl, Dv, ws.tmp, ws.dot + l0, ld_q);
      }
      // The forward's scores are (scale Q) K^T: the same products here, so P matches the forward's lse.
      for (int64_t d = 0; d < D; ++d) scale_row(ws.qt + d * ld_q + r0, L - r0, scale_);
      ws.q_op = head_operand(q, qs[2], qs[3], r0, L, D, plan_.q_in_place, ws.q);
      ws.do_op = head_operand(dout, gs[2], gs[3], r0, L, Dv, plan_.do_in_place, ws.dout);
    }

    for (int64_t l = r0; l < L; ++l) {
      ws.lse[l] = lse[l * ls[2]];
      if (plan_.whole_rows) continue;  // delta comes from the tile pair (run_pair)
      // Read in place, whatever the products read: converting is exact.
      const scalar_t* o = out + l * os[2];
      const scalar_t* g = dout + l * gs[2];
      acc_t sum = 0;
      for (int64_t j = 0; j < Dv; ++j)
        sum += static_cast<acc_t>(g[j * gs[3]]) * static_cast<acc_t>(o[j * os[3]]);
      ws.delta[l] = sum;
    }
  }

  // Rows [r0, L) of a (L, cols) block of the head as a GEMM operand whose row l is at ptr + l * ld: the input
  // itself, or its rows converted into `pack`.
  Operand<acc_t> head_operand(const scalar_t* src, int64_t row_stride, int64_t col_stride, int64_t r0,
                              int64_t L, int64_t cols, bool in_place, acc_t* pack) const {
    const int64_t dense_ld = std::max<int64_t>(cols, 1);
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      if (in_place) return {src, L <= 1 ? dense_ld : row_stride};
    }
    pack_block(src + r0 * row_stride, row_stride, col_stride, L - r0, cols, acc_t(1), pack + r0 * dense_ld,
               dense_ld);
    return {pack, dense_ld};
  }

  // The key padding bias of keys [k0, k0 + nk) of batch b into ws.key_bias, plus attn_mask's value when that
  // is the same for every query. Returns ws.key_bias, or null when there is neither.
  const acc_t* key_bias(int64_t b, int64_t h, int64_t k0, int64_t nk, BackwardScratch<acc_t>& ws) const {
    const bool padding = p_.key_padding_mask_kind != kMaskNone;
    const bool mask_shared = p_.attn_mask_kind != kMaskNone && !plan_.mask_rows;
    if (!padding && !mask_shared) return nullptr;
    if (padding) {
      const int64_t* st = p_.key_padding_mask_stride;
      visit_mask(p_.key_padding_mask_kind, d_.fwd.key_padding_mask, [&](auto m) {
        mask_to_bias<acc_t>(m + b * st[0] + k0 * st[1], st[1], nk, nullptr, ws.key_bias);
      });
    }
    if (mask_shared) {
      // attn_mask + key padding, in the reference's order.
      const int64_t* st = p_.attn_mask_stride;
      visit_mask(p_.attn_mask_kind, d_.fwd.attn_mask, [&](auto m) {
        mask_to_bias<acc_t>(m + b * st[0] + h * st[1] + k0 * st[3], st[3], nk,
                            padding ? ws.key_bias : nullptr, ws.key_bias);
      });
    }
    return ws.key_bias;
  }

  // Key tile kt of head (b, h) against every query tile that sees it: adds to the tile's dK and dV in dk
  // (nk, D) and dv (nk, Dv).
  void run_key_tile(int64_t b, int64_t h, int64_t kt, const SeqRange& seq, acc_t* dqt, acc_t* dk, acc_t* dv,
                    BackwardScratch<acc_t>& ws) {
    const int64_t L = seq.q_len, S = seq.k_slot, D = p_.head_dim, Dv = p_.v_head_dim, kv_len_b = seq.kv_len;
    const int64_t k0 = kt * plan_.bk;
    const int64_t *ks = p_.k_stride, *vs = p_.v_stride;
    // Keys at or past kv_len_b are seen by no query and never read (a static cache's unfilled slots may hold
    // anything): the tile is cut there. The rest of it is seen by queries [q_begin, q_end) between them
    // (attnx/key_range.h).
    const int64_t nk = std::min(plan_.bk, std::min(S, kv_len_b) - k0), k_last = k0 + nk - 1;
    if (nk <= 0 || skip_.padding_skips(b, kt)) return;
    const int64_t q_begin = range_query_begin(k0, L, kv_len_b, p_.window_right, p_.is_causal);
    const int64_t q_end = range_query_end(k_last, L, kv_len_b, p_.window_left);
    if (q_begin >= q_end) return;
    const int64_t hk = kv_head(p_, h);
    const int64_t s0 = seq.k_begin + k0;
    const auto* k = static_cast<const scalar_t*>(d_.fwd.key) + b * ks[0] + hk * ks[1] + s0 * ks[2];
    const auto* v = static_cast<const scalar_t*>(d_.fwd.value) + b * vs[0] + hk * vs[1] + s0 * vs[2];
    Operand<op_t> ka{}, va{};
    if constexpr (kPairs) {
      // K's rows (for S^T) and its transposed row pairs (for dQ^T); V's rows (for dP^T).
      const int64_t D2 = (D + 1) / 2, Dv2 = (Dv + 1) / 2;
      if (D > 0) {
        pack_pairs(k, ks[2], ks[3], nk, D, ws.kp, D2);
        pack_row_pairs(k, ks[2], ks[3], nk, D, ws.krp, D);
        transpose(ws.krp, D, ws.ktp, ws.ld_kp, (nk + 1) / 2, D);
        ka = {ws.kp, D2};
      }
      if (Dv > 0) {
        pack_pairs(v, vs[2], vs[3], nk, Dv, ws.vp, Dv2);
        va = {ws.vp, Dv2};
      }
    } else {
      if (D > 0) {
        ka = b_operand(k, ks[2], ks[3], nk, D, ws.k);
        transpose(ka.ptr, ka.ld, ws.kt, plan_.ld_k, nk, D);
      }
      if (Dv > 0) va = b_operand(v, vs[2], vs[3], nk, Dv, ws.v);
    }
    const acc_t* kb = key_bias(b, h, k0, nk, ws);
    for (int64_t qt = q_begin / plan_.bq; qt * plan_.bq < q_end; ++qt) {
      const int32_t block = skip_.block_class(b, h, qt, kt);
      if (block == kBlockEmpty || skip_.mask_skips(b, h, qt, kt)) continue;
      const int64_t q0 = qt * plan_.bq, nq = std::min(plan_.bq, L - q0);
      run_pair(b, h, q0, nq, k0, nk, L, kv_len_b, ka, va, kb, block >= 0 ? block : kBlockFull, dqt, dk, dv,
               ws);
    }
  }

  // Queries [q0, q0 + nq) against keys [k0, k0 + nk): recompute P^T, form dS^T, accumulate dV, dK, dQ^T.
  // block: the pair's bit rows in block_bits when the block-sparse mask makes it PARTIAL, else kBlockFull.
  void run_pair(int64_t b, int64_t h, int64_t q0, int64_t nq, int64_t k0, int64_t nk, int64_t L,
                int64_t kv_len_b, const Operand<op_t>& ka, const Operand<op_t>& va, const acc_t* kb,
                int32_t block, acc_t* dqt, acc_t* dk, acc_t* dv, BackwardScratch<acc_t>& ws) {
    const int64_t D = p_.head_dim, Dv = p_.v_head_dim, ld_q = plan_.ld_q, ld_t = plan_.ld_t;
    // S^T (nk, nq) = K (scale Q)^T;  dP^T (nk, nq) = V dO^T. With pairs the inner dims are D2 and Dv2 pairs,
    // which are also ka's and va's row strides (pack_pairs's dense rows).
    [[maybe_unused]] const int64_t D2 = (D + 1) / 2, Dv2 = (Dv + 1) / 2;
    if constexpr (kPairs) {
      if (D > 0)
        gemm_pairs(nk, nq, D2, ka.ptr, ka.ld, ws.qtp + q0, ld_q, ws.s, ld_t, /*add_c=*/false, scale_);
    } else if (D > 0) {
      tile_gemm(nk, nq, D, ka.ptr, ka.ld, ws.qt + q0, ld_q, ws.s, ld_t, /*add_c=*/false);
    }
    if (D == 0) {
      for (int64_t r = 0; r < nk; ++r) std::fill_n(ws.s + r * ld_t, nq, acc_t(0));
    }
    const bool capped = softcap_ > acc_t(0);
    if (capped) {
      for (int64_t r = 0; r < nk; ++r)
        softcap_backward_row(ws.s + r * ld_t, ws.deriv + r * ld_t, nq, softcap_);
    }
    if constexpr (kPairs) {
      if (Dv > 0)
        gemm_pairs(nk, nq, Dv2, va.ptr, va.ld, ws.dotp + q0, ld_q, ws.dp, ld_t, /*add_c=*/false, 1.0f);
    } else if (Dv > 0) {
      tile_gemm(nk, nq, Dv, va.ptr, va.ld, ws.dot + q0, ld_q, ws.dp, ld_t, /*add_c=*/false);
    }
    if (Dv == 0) {
      for (int64_t r = 0; r < nk; ++r) std::fill_n(ws.dp + r * ld_t, nq, acc_t(0));
    }

    // A mask that differs between queries: its (nq, nk) block (key padding added) is read one query row at a
    // time, in its own layout, then transposed to the tile's key-major layout. A PARTIAL block's bits are
    // -inf on top (on the key padding, or on 0).
    const acc_t* bias = nullptr;
    if (plan_.mask_rows) {
      const int64_t* st = p_.attn_mask_stride;
      visit_mask(p_.attn_mask_kind, d_.fwd.attn_mask, [&](auto m) {
        const auto* base = m + b * st[0] + h * st[1] + k0 * st[3];
        for (int64_t i = 0; i < nq; ++i) {
          mask_to_bias<acc_t>(base + (q0 + i) * st[2], st[3], nk, kb, ws.rows + i * plan_.ld_k);
        }
      });
    } else if (block >= 0) {
      for (int64_t i = 0; i < nq; ++i) {
        acc_t* row = ws.rows + i * plan_.ld_k;
        if (kb) {
          std::copy_n(kb, nk, row);
        } else {
          std::fill_n(row, nk, acc_t(0));
        }
      }
    }
    if (block >= 0) {
      for (int64_t i = 0; i < nq; ++i) {
        mask_out_bits(ws.rows + i * plan_.ld_k, skip_.block_bits_row(block, i),
                      skip_.block_bits_word_stride(), nk);
      }
    }
    if (plan_.mask_rows || block >= 0) {
      transpose(ws.rows, plan_.ld_k, ws.bias, ld_t, nq, nk);
      bias = ws.bias;
    }

    // Dropout: the pair's factors, generated along query rows (where four keys share a Philox block), then
    // transposed to the key-major layout.
    if (p_.dropout) {
      const int64_t row0 = (b * p_.heads + h) * p_.q_len + q0;
      for (int64_t i = 0; i < nq; ++i) {
        dropout_factors(p_, row0 + i, k0, nk, dropout_scale_, ws.drop_rows + i * plan_.ld_k);
      }
      transpose(ws.drop_rows, plan_.ld_k, ws.drop, ld_t, nq, nk);
    }

    // The queries that see key k0 + r: [lo, hi) of the tile (is_causal, key lengths, the window).
    const auto query_range = [&](int64_t r, int64_t& lo, int64_t& hi) {
      const int64_t s = k0 + r;
      hi = std::clamp<int64_t>(range_query_end(s, L, kv_len_b, p_.window_left) - q0, 0, nq);
      lo = std::clamp<int64_t>(range_query_begin(s, L, kv_len_b, p_.window_right, p_.is_causal) - q0, 0, hi);
    };
    if (plan_.whole_rows) {
      int32_t lo[kBackwardKeysPerTile], hi[kBackwardKeysPerTile];
      for (int64_t r = 0; r < nk; ++r) {
        int64_t l, h;
        query_range(r, l, h);
        lo[r] = static_cast<int32_t>(l);
        hi[r] = static_cast<int32_t>(h);
      }
      softmax_backward_whole_rows(ws.s, ws.dp, ld_t, bias, (kb && !bias) ? kb : nullptr, ws.lse + q0, lo, hi,
                                  nk, nq);
    } else {
      for (int64_t r = 0; r < nk; ++r) {
        int64_t lo, hi;
        query_range(r, lo, hi);
        const acc_t* row_mask = bias ? bias + r * ld_t : nullptr;
        const acc_t row_bias = (kb && !bias) ? kb[r] : acc_t(0);
        if (p_.dropout) {
          softmax_backward_row_dropout(ws.s + r * ld_t, ws.dp + r * ld_t, row_mask, row_bias, ws.lse + q0,
                                       ws.delta + q0, ws.drop + r * ld_t, lo, hi, nq);
        } else {
          softmax_backward_row(ws.s + r * ld_t, ws.dp + r * ld_t, row_mask, row_bias, ws.lse + q0,
                               ws.delta + q0, lo, hi, nq);
        }
      }
    }
    // dS is the gradient of the score the masks were added to: the mask's gradient; the soft-cap's derivative
    // then carries it to the scaled score that Q and K produced.
    if (plan_.mask_grad) add_mask_grad(b, h, q0, nq, k0, nk, ws);
    if (capped) {
      for (int64_t r = 0; r < nk; ++r) mul_row(ws.dp + r * ld_t, ws.deriv + r * ld_t, nq);
    }

    // dV (nk, Dv) += P^T dO;  dK (nk, D) += dS^T Q;  dQ^T (D, nq) += K^T dS^T. (scale: applied when written.)
    if constexpr (kPairs) {
      products_pairs(q0, nq, nk, dqt, dk, dv, ws);
      return;
    }
    if (Dv > 0) {
      tile_gemm(nk, Dv, nq, ws.s, ld_t, ws.do_op.ptr + q0 * ws.do_op.ld, ws.do_op.ld, dv, Dv, /*add_c=*/true);
    }
    if (D > 0) {
      tile_gemm(nk, D, nq, ws.dp, ld_t, ws.q_op.ptr + q0 * ws.q_op.ld, ws.q_op.ld, dk, D, /*add_c=*/true);
      tile_gemm(D, nq, nk, ws.kt, plan_.ld_k, ws.dp, ld_t, dqt + q0, ld_q, /*add_c=*/true);
    }
  }

  // run_pair's last three products on bfloat16 pairs: P^T and dS^T rounded along queries (the A operands of
  // dV and dK, against the query tile's row pairs of dO and Q), dS^T rounded along keys (dQ^T's B operand,
  // against K^T's pairs along keys). A tile's odd last query or key pairs with a zero.
  void products_pairs(int64_t q0, int64_t nq, int64_t nk, acc_t* dqt, acc_t* dk, acc_t* dv,
                      BackwardScratch<acc_t>& ws) const {
    if constexpr (kPairs) {
      const int64_t D = p_.head_dim, Dv = p_.v_head_dim, ld_t = plan_.ld_t, nq2 = (nq + 1) / 2;
      const int64_t row_pairs = q0 / plan_.bq * ws.bq2;
      if (Dv > 0) {
        for (int64_t r = 0; r < nk; ++r) to_bf16_pairs(ws.s + r * ld_t, nq, ws.pp + r * ws.ld_tp);
        gemm_pairs(nk, Dv, nq2, ws.pp, ws.ld_tp, ws.dorp + row_pairs * Dv, Dv, dv, Dv, /*add_c=*/true, 1.0f);
      }
      if (D > 0) {
        for (int64_t r = 0; r < nk; ++r) to_bf16_pairs(ws.dp + r * ld_t, nq, ws.dsp + r * ws.ld_tp);
        gemm_pairs(nk, D, nq2, ws.dsp, ws.ld_tp, ws.qrp + row_pairs * D, D, dk, D, /*add_c=*/true, 1.0f);
        for (int64_t t = 0; 2 * t < nk; ++t) {
          const acc_t* a = ws.dp + 2 * t * ld_t;
          uint32_t* dst = ws.dsrp + t * ld_t;
          if (2 * t + 1 < nk) {
            to_bf16_row_pairs(a, a + ld_t, nq, dst);
          } else {
            to_bf16_row_pairs(a, a, nq, dst);
            for (int64_t j = 0; j < nq; ++j) dst[j] &= 0xffffu;
          }
        }
        gemm_pairs(D, nq, (nk + 1) / 2, ws.ktp, ws.ld_kp, ws.dsrp, ld_t, dqt + q0, plan_.ld_q, /*add_c=*/true,
                   1.0f);
      }
    }
  }

  // dS^T of the tile pair (nk, nq) in ws.dp, added to attn_mask's gradient: element (b, h, l, s) goes to the
  // buffer's (b, h, l, s), each index taken as 0 along a dim the gradient is summed over. Only this item
  // writes there (BackwardPlan's slots), so a plain add is race-free.
  void add_mask_grad(int64_t b, int64_t h, int64_t q0, int64_t nq, int64_t k0, int64_t nk,
                     BackwardScratch<acc_t>& ws) const {
    const int64_t* g = bp_.grad_attn_mask_size;
    auto* base = static_cast<acc_t*>(d_.grad_attn_mask) +
                 ((g[0] == 1 ? 0 : b) * g[1] + (g[1] == 1 ? 0 : h)) * g[2] * g[3];
    // Back to query rows, so that a row of the gradient is one vectorised add.
    transpose(ws.dp, plan_.ld_t, ws.rows, plan_.ld_k, nk, nq);
    for (int64_t i = 0; i < nq; ++i) {
      const acc_t* src = ws.rows + i * plan_.ld_k;
      acc_t* dst = base + (g[2] == 1 ? 0 : q0 + i) * g[3];
      if (g[3] == 1) {
        acc_t sum = 0;
        for (int64_t j = 0; j < nk; ++j) sum += src[j];
        dst[0] += sum;
      } else {
        add_row(dst + k0, src, nk);
      }
    }
  }

  // dK (scaled here) and dV of keys [k0, k0 + nk) of kv head (b, hk), from dk (nk, D) and dv (nk, Dv).
  void write_key_tile(int64_t b, int64_t hk, int64_t k0, int64_t nk, const acc_t* dk_acc,
                      const acc_t* dv_acc) const {
    const int64_t D = p_.head_dim, Dv = p_.v_head_dim;
    const int64_t *gk = bp_.grad_key_stride, *gv = bp_.grad_value_stride;
    auto* dk = static_cast<scalar_t*>(d_.grad_key) + b * gk[0] + hk * gk[1] + k0 * gk[2];
    auto* dv = static_cast<scalar_t*>(d_.grad_value) + b * gv[0] + hk * gv[1] + k0 * gv[2];
    for (int64_t r = 0; r < nk; ++r) {
      for (int64_t j = 0; j < D; ++j)
        dk[r * gk[2] + j * gk[3]] = static_cast<scalar_t>(dk_acc[r * D + j] * scale_);
      for (int64_t j = 0; j < Dv; ++j) dv[r * gv[2] + j * gv[3]] = static_cast<scalar_t>(dv_acc[r * Dv + j]);
    }
  }

  // Rows of query tile qt of dQ for head (b, h) from dqt (D, ld_q) = dQ^T / scale; tmp holds (bq, D).
  void write_dq_tile(int64_t b, int64_t h, int64_t qt, const SeqRange& seq, const acc_t* dqt,
                     acc_t* tmp) const {
    const int64_t L = seq.q_len, D = p_.head_dim;
    if (D == 0) return;
    const int64_t q0 = qt * plan_.bq, nq = std::min(plan_.bq, L - q0);
    const int64_t* gq = bp_.grad_query_stride;
    auto* dq = static_cast<scalar_t*>(d_.grad_query) + b * gq[0] + h * gq[1] + (seq.q_begin + q0) * gq[2];
    transpose(dqt + q0, plan_.ld_q, tmp, D, D, nq);
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < D; ++j)
        dq[i * gq[2] + j * gq[3]] = static_cast<scalar_t>(tmp[i * D + j] * scale_);
    }
  }

  // With several chunks per head: dQ^T of each head is the sum of its chunks' slots.
  void reduce_dq_slots(acc_t* slots) const {
    const int64_t BH = p_.batch * p_.heads, H = p_.heads, D = p_.head_dim, ld_q = plan_.ld_q;
    const int64_t chunks = plan_.chunks, slot = D * ld_q, qt_n = plan_.q_tiles;
    parallel_for(0, BH * qt_n, 1, [&](int64_t begin, int64_t end) {
      AlignedBuffer<acc_t> tmp_storage(plan_.bq * D);
      acc_t* tmp = tmp_storage.data();
      for (int64_t i = begin; i < end; ++i) {
        const int64_t bh = i / qt_n, qt = i % qt_n;
        const SeqRange seq = seq_range(p_, d_.fwd, bh / H);
        const int64_t q0 = qt * plan_.bq, nq = std::min(plan_.bq, seq.q_len - q0);
        if (nq <= 0) continue;  // past a shorter sequence's queries
        acc_t* first = slots + bh * chunks * slot;
        for (int64_t c = 1; c < chunks; ++c) {
          for (int64_t d = 0; d < D; ++d)
            add_row(first + d * ld_q + q0, first + c * slot + d * ld_q + q0, nq);
        }
        write_dq_tile(bh / H, bh % H, qt, seq, first, tmp);
      }
    });
  }

  const AttentionBackwardParams& bp_;
  const AttentionParams& p_;
  const AttentionBackwardPointers& d_;
  BackwardPlan plan_;
  const acc_t scale_;
  const acc_t dropout_scale_;  // 1 / (1 - p) when p_.dropout
  const acc_t softcap_;        // 0: no soft-capping
  AlignedBuffer<acc_t> slots_storage_;
  TileSkipFlags<acc_t> skip_;
};

}  // namespace

void attention_backward_kernel(const AttentionBackwardParams& p, const AttentionBackwardPointers& ptr,
                               torch::headeronly::ScalarType dtype) {
#if ATTNX_DOT_BF16 == 2
  // As the forward's: the emulation's own kernel for bfloat16 alone, DEFAULT's for the other dtypes.
  if (dtype != torch::headeronly::ScalarType::BFloat16) {
    return DEFAULT::attention_backward_kernel(p, ptr, dtype);
  }
  AttentionBackwardCpu<torch::headeronly::BFloat16>(p, ptr).run();
#else
  dispatch_float_types(dtype, "attnx::attention_backward",
                       [&](auto tag) { AttentionBackwardCpu<decltype(tag)>(p, ptr).run(); });
#endif
}

}  // namespace CPU_CAPABILITY
}  // namespace attnx::cpu
