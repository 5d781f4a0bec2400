// The arithmetic end of a reduction through all-to-all on the CPU ([Note: reduce-scatter through
// all-to-all] in overlap/comm.py): the rows every rank sent, summed in rank order, then the first
// `divide_numel` elements divided by `divisor` (the gradient average), in one parallel pass.
// Defined by overlap/kernels/reduce.py's `sum_rows_ref` (torch.add left to right, then div_): each
// operation rounds to the row dtype as torch's does (fp32 arithmetic, bf16/fp16 rounded after
// every add and after the division, true division, no reciprocal), so results are bitwise equal.
//
// Registered into the same torch.ops.overlap_cpu namespace as quantize.cpp (a fragment).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// Elements per parallel task: ~128 KiB of fp32 per row, enough to amortise the task overhead.
constexpr int64_t kGrainElems = 1 << 15;

template <typename scalar_t>
void sum_rows_impl(const std::vector<const scalar_t*>& rows, scalar_t* out, int64_t numel, int64_t divide_numel,
                   double divisor_in) {
  using acc_t = at::opmath_type<scalar_t>;  // float for bf16/fp16/fp32, double for fp64
  const acc_t divisor = static_cast<acc_t>(divisor_in);
  const int64_t num_rows = static_cast<int64_t>(rows.size());
  at::parallel_for(0, numel, kGrainElems, [&](int64_t begin, int64_t end) {
    // the output never aliases a row (the caller allocates it): __restrict__ lets the loops vectorise
    scalar_t* __restrict__ o = out;
    const scalar_t* __restrict__ r0 = rows[0];
    const scalar_t* __restrict__ r1 = rows[1];
    const int64_t stop = std::max(begin, std::min(end, divide_numel));
    if (num_rows == 2) {  // the common case (two ranks): add and divide in one loop
      for (int64_t i = begin; i < stop; ++i)
        o[i] = static_cast<scalar_t>(static_cast<acc_t>(static_cast<scalar_t>(static_cast<acc_t>(r0[i]) + static_cast<acc_t>(r1[i]))) / divisor);
      for (int64_t i = stop; i < end; ++i) o[i] = static_cast<scalar_t>(static_cast<acc_t>(r0[i]) + static_cast<acc_t>(r1[i]));
      return;
    }
    for (int64_t i = begin; i < end; ++i) o[i] = static_cast<scalar_t>(static_cast<acc_t>(r0[i]) + static_cast<acc_t>(r1[i]));
    for (int64_t r = 2; r < num_rows; ++r) {
      const scalar_t* __restrict__ rr = rows[r];
      for (int64_t i = begin; i < end; ++i) o[i] = static_cast<scalar_t>(static_cast<acc_t>(o[i]) + static_cast<acc_t>(rr[i]));
    }
    for (int64_t i = begin; i < stop; ++i) o[i] = static_cast<scalar_t>(static_cast<acc_t>(o[i]) / divisor);
  });
}

void sum_rows(at::TensorList rows, const at::Tensor& out, int64_t divide_numel, double divisor) {
  TORCH_CHECK(rows.size() >= 2, "overlap sum_rows: needs at least two rows");
  const int64_t numel = out.numel();
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous(), "overlap sum_rows: out must be a contiguous CPU tensor");
  TORCH_CHECK(0 <= divide_numel && divide_numel <= numel, "overlap sum_rows: divide_numel out of range");
  for (const auto& row : rows) {
    TORCH_CHECK(row.device().is_cpu() && row.is_contiguous() && row.numel() == numel &&
                    row.scalar_type() == out.scalar_type(),
                "overlap sum_rows: every row must be contiguous on CPU with out's dtype and numel");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "overlap_sum_rows", [&] {
    std::vector<const scalar_t*> ptrs;
    for (const auto& row : rows) ptrs.push_back(row.data_ptr<scalar_t>());
    sum_rows_impl<scalar_t>(ptrs, out.data_ptr<scalar_t>(), numel, divide_numel, divisor);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(overlap_cpu, m) {
  m.def("sum_rows(Tensor[] rows, Tensor(a!) out, int divide_numel, float divisor) -> ()", &sum_rows);
}
