// attnx: the Metal launch plans against the library they launch from (see test_metal_emulation.py).
//
// csrc/mps/metal_plan.h names a kernel, a grid and the threadgroup memory for every call the glue makes; the
// emulation's runtime registers every instantiation of metal/*.metal under its host name and records the
// threadgroup memory a launch's kernel declares. Checked here, on AttentionParams and LinearParams built in
// C++ as the glue builds them: every planned name is instantiated and every instantiation is planned for
// some call; the grids stay within Metal's limits where B * H or the rows are large; the threadgroup memory a
// plan states is what its kernel declares, within every Apple GPU's 32 KiB.
//
// Prints one line per failed check and "ok" when there is none; the exit status is the number of failures.
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "../race_check.h"
#include "launches.h"

namespace {

namespace cfg = attnx::metal_config;
namespace mps = attnx::mps;
using attnx::AttentionParams;
using attnx::LinearParams;
using attnx::race_check::unmasked;
using mps::DType;

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

int failures = 0;

void check(bool ok, const std::string& what, long long a = 0, long long b = 0) {
  if (ok) return;
  std::printf("FAILED: %s (%lld, %lld)\n", what.c_str(), a, b);
  ++failures;
}

// A contiguous (M, K) input times an (N, K) weight, with a bias.
LinearParams linear_params(int64_t M, int64_t K, int64_t N) {
  LinearParams p{};
  p.rows = M, p.rows_inner = 1, p.in_features = K, p.out_features = N;
  p.input_stride[0] = K, p.input_stride[2] = 1;
  p.weight_stride[0] = K, p.weight_stride[1] = 1;
  p.bias_stride = 1, p.has_bias = 1;
  p.out_stride[0] = N, p.out_stride[2] = 1;
  return p;
}

const char* attention_kind(mps::AttentionKernel kernel) {
  return kernel == mps::AttentionKernel::kVector ? "vector" : "tiled";
}

// Every planned name is instantiated, and every instantiation is planned for some call: head dims around each
// bucket's edges, query lengths around the vector kernel's, rows around GEMV's.
void plans_name_instantiated_kernels() {
  std::set<std::string> planned;
  for (DType dtype : kDTypes) {
    for (int64_t d : {1, 32, 33, 64, 65, 128, 129, 256}) {
      for (int64_t L : {int64_t{1}, int64_t{cfg::kVectorMaxQueries}, int64_t{cfg::kVectorMaxQueries} + 1,
                        int64_t{100}}) {
        const mps::AttentionPlan plan = mps::plan_attention(unmasked(1, 1, 1, L, 1, d, d), dtype);
        const std::string name = plan.launch.name;
        check(plan.kernel != mps::AttentionKernel::kNone, "a kernel for head dim " + std::to_string(d), d,
              L);
        const std::string expected = std::string("attention_") + attention_kind(plan.kernel) + "_d" +
                                     std::to_string(plan.bucket) + "_" + mps::dtype_name(dtype);
        check(name == expected, "the plan's kernel and bucket: " + name + " vs " + expected, d, L);
        check(plan.launch.threadgroup_bytes <= cfg::kMaxThreadgroupMemory && plan.launch.threads == 128,
              "threadgroup memory and size of " + name, plan.launch.threadgroup_bytes, plan.launch.threads);
        planned.insert(name);
      }
    }
    for (int64_t rows : {int64_t{1}, int64_t{cfg::kGemvMaxRows}, int64_t{cfg::kGemvMaxRows} + 1}) {
      planned.insert(mps::plan_linear(linear_params(rows, 4, 4), dtype).launch.name);
    }
  }
  std::set<std::string> instantiated;
  for (int i = 0; i < attnx_emu_metal::kernel_count(); ++i) {
    instantiated.insert(attnx_emu_metal::kernel_name(i));
  }
  for (const std::string& name : planned) {
    check(instantiated.count(name) == 1, "planned, not instantiated: " + name);
  }
  for (const std::string& name : instantiated) {
    check(planned.count(name) == 1, "instantiated, never planned: " + name);
  }
  std::printf("%zu kernels planned, %zu instantiated\n", planned.size(), instantiated.size());
}

// Grids: B * H on grid.y, with no 65535 limit on either dimension; no kernel above head dim 256.
void plan_grids_and_limits() {
  for (int64_t L : {int64_t{70}, int64_t{5}}) {
    const mps::AttentionPlan plan =
        mps::plan_attention(unmasked(300, 300, 300, L, 5, 8, 8), DType::kFloat32);
    const int64_t blocks =
        plan.kernel == mps::AttentionKernel::kVector ? L : (L + cfg::kTiledRows - 1) / cfg::kTiledRows;
    check(plan.launch.grid[0] == blocks && plan.launch.grid[1] == 90000 && plan.launch.grid[2] == 1,
          std::string("attention grid of the ") + attention_kind(plan.kernel) + " kernel",
          plan.launch.grid[0], plan.launch.grid[1]);
  }
  for (auto [D, Dv] : {std::pair<int64_t, int64_t>{257, 8}, {8, 300}}) {
    const AttentionParams p = unmasked(1, 1, 1, 3, 5, D, Dv);
    const mps::AttentionPlan plan = mps::plan_attention(p, DType::kFloat32);
    check(plan.kernel == mps::AttentionKernel::kNone, "no kernel above head dim 256", D, Dv);
    std::vector<float> buffer(1024);
    float* b = buffer.data();
    check(attnx_emu_metal::launch_attention(p, DType::kFloat32, b, b, b, nullptr, nullptr, b, b, nullptr,
                                            nullptr) == 3,
          "no launch above head dim 256", D, Dv);
  }
  // GEMM: tiles of kGemmTile outputs by kGemmTile rows; GEMV: one threadgroup of kGemvSimdgroups outputs.
  mps::LinearPlan plan = mps::plan_linear(linear_params(100, 4, 70), DType::kFloat16);
  check(plan.kernel == mps::LinearKernel::kGemm && plan.launch.grid[0] == 3 && plan.launch.grid[1] == 4 &&
            plan.launch.grid[2] == 1,
        "gemm grid", plan.launch.grid[0], plan.launch.grid[1]);
  plan = mps::plan_linear(linear_params(8, 4, 70), DType::kFloat16);
  check(plan.kernel == mps::LinearKernel::kGemv && plan.launch.grid[0] == 18 && plan.launch.grid[1] == 1 &&
            plan.launch.grid[2] == 1,
        "gemv grid", plan.launch.grid[0], plan.launch.grid[1]);
}

// The threadgroup memory each kernel declares when it runs is what its plan says, within 32 KiB.
void threadgroup_memory_is_what_the_plan_says() {
  struct Case {
    mps::AttentionKernel kernel;
    int64_t L, d;
  };
  const int64_t tiled = cfg::kVectorMaxQueries + 1;
  using mps::AttentionKernel;
  const Case cases[] = {{AttentionKernel::kVector, 1, 32}, {AttentionKernel::kVector, 1, 256},
                        {AttentionKernel::kTiled, tiled, 32}, {AttentionKernel::kTiled, tiled, 128}};
  for (const Case& c : cases) {
    const AttentionParams p = unmasked(1, 1, 1, c.L, 3, c.d, c.d);
    const mps::AttentionPlan plan = mps::plan_attention(p, DType::kFloat32);
    check(plan.kernel == c.kernel, std::string("the case takes the ") + attention_kind(c.kernel) + " kernel",
          c.L, c.d);
    std::vector<float> q(c.L * c.d), kv(3 * c.d), out(c.L * c.d), lse(c.L);
    check(attnx_emu_metal::launch_attention(p, DType::kFloat32, q.data(), kv.data(), kv.data(), nullptr,
                                            nullptr, out.data(), lse.data(), nullptr, nullptr) == 0,
          "attention launch", c.L, c.d);
    const size_t declared = attnx_emu_metal::last_threadgroup_bytes();
    std::printf("%s: %zu bytes of threadgroup memory\n", plan.launch.name, declared);
    check(declared == static_cast<size_t>(plan.launch.threadgroup_bytes) &&
              declared <= cfg::kMaxThreadgroupMemory,
          std::string("threadgroup memory of ") + plan.launch.name, static_cast<long long>(declared),
          plan.launch.threadgroup_bytes);
  }
  const LinearParams p = linear_params(40, 8, 8);
  const mps::LinearPlan plan = mps::plan_linear(p, DType::kFloat32);
  std::vector<float> x(40 * 8), w(8 * 8), b(8), out(40 * 8);
  check(attnx_emu_metal::launch_linear(p, DType::kFloat32, x.data(), w.data(), b.data(), out.data()) == 0,
        "linear launch");
  check(attnx_emu_metal::last_threadgroup_bytes() == static_cast<size_t>(plan.launch.threadgroup_bytes),
        std::string("threadgroup memory of ") + plan.launch.name,
        static_cast<long long>(attnx_emu_metal::last_threadgroup_bytes()), plan.launch.threadgroup_bytes);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string only = argc > 1 ? argv[1] : "";
  if (only.empty() || only == "names") plans_name_instantiated_kernels();
  if (only.empty() || only == "grids") plan_grids_and_limits();
  if (only.empty() || only == "threadgroup_memory") threadgroup_memory_is_what_the_plan_says();
  if (failures == 0) std::printf("ok\n");
  return failures;
}
