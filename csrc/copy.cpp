// Fused copy-out / copy-in with cast for the CPU: many tensors to or from one flat buffer in one
// parallel pass. The layout is defined in overlap/kernels/copy.py ([Note: fused copy layout]):
// flat viewed as (num_rows, W) is cut along dim 1 into column blocks, one per tensor; tensor i
// fills the first data_cols_i columns of its block row by row, the rest is zero padding.
//
// The job is indexed by g in [0, num_rows * W) in segment-major order (segment i covers
// [num_rows * off_i, num_rows * (off_i + cols_i)), row-major inside), which is contiguous on the
// many-tensor side. at::parallel_for hands each thread a range of g; the thread finds its first
// segment by binary search and walks runs that stay inside one row of one segment: each run is
// one contiguous cast-copy (and a memset for padding), so the inner loops vectorise.
//
// Casts match torch's Tensor.to bitwise for finite and infinite values: fp32 -> bf16 rounds
// half to even on the bits (as c10::BFloat16 does), bf16 -> fp32 is exact, fp16 goes through
// c10::Half. NaN stays NaN (sign and payload unspecified, as in torch).
//
// Registered into the same torch.ops.overlap_cpu namespace as quantize.cpp (a fragment).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// Elements per parallel task: ~128 KiB of fp32 each way, enough to amortise the task overhead.
constexpr int64_t kGrainElems = 1 << 15;

using CastFn = void (*)(const void* src, void* dst, int64_t n);

inline uint32_t float_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

inline float bits_float(uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

// Branch-free so that the loop vectorises; same rounding as c10::round_to_nearest_even.
inline uint16_t float_to_bf16_bits(float v) {
  const uint32_t b = float_bits(v);
  const uint32_t rounded = (b + UINT32_C(0x7FFF) + ((b >> 16) & 1u)) >> 16;
  return v != v ? UINT16_C(0x7FC0) : static_cast<uint16_t>(rounded);
}

template <typename S, typename D>
__attribute__((always_inline)) inline void cast_loop(const void* src, void* dst, int64_t n) {
  const S* s = static_cast<const S*>(src);
  D* d = static_cast<D*>(dst);
  if constexpr (std::is_same_v<S, D>) {
    std::memcpy(d, s, n * sizeof(S));
  } else if constexpr (std::is_same_v<S, float> && std::is_same_v<D, c10::BFloat16>) {
    uint16_t* o = reinterpret_cast<uint16_t*>(d);
    for (int64_t i = 0; i < n; ++i) o[i] = float_to_bf16_bits(s[i]);
  } else if constexpr (std::is_same_v<S, c10::BFloat16> && std::is_same_v<D, float>) {
    const uint16_t* in = reinterpret_cast<const uint16_t*>(s);
    for (int64_t i = 0; i < n; ++i) d[i] = bits_float(static_cast<uint32_t>(in[i]) << 16);
  } else if constexpr (std::is_same_v<D, c10::BFloat16>) {
    uint16_t* o = reinterpret_cast<uint16_t*>(d);
    for (int64_t i = 0; i < n; ++i) o[i] = float_to_bf16_bits(static_cast<float>(s[i]));
  } else {  // via fp32, as torch converts half <-> bfloat16 and half <-> float
    for (int64_t i = 0; i < n; ++i) d[i] = static_cast<D>(static_cast<float>(s[i]));
  }
}

// Wider vectors where the CPU has them, picked at run time as in quantize.cpp (integer and
// exact operations only, so both copies give the same bits).
template <typename S, typename D>
__attribute__((target("avx2"))) void cast_run_avx2(const void* src, void* dst, int64_t n) {
  cast_loop<S, D>(src, dst, n);
}

template <typename S, typename D>
void cast_run_base(const void* src, void* dst, int64_t n) {
  cast_loop<S, D>(src, dst, n);
}

template <typename S, typename D>
CastFn cast_run() {
  // OVERLAP_CPU_BASELINE=1 forces the baseline copy (tests compare both with the reference).
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && std::getenv("OVERLAP_CPU_BASELINE") == nullptr;
  return has_avx2 ? &cast_run_avx2<S, D> : &cast_run_base<S, D>;
}

template <typename S>
CastFn cast_to(at::ScalarType dst) {
  switch (dst) {
    case at::kFloat: return cast_run<S, float>();
    case at::kBFloat16: return cast_run<S, c10::BFloat16>();
    case at::kHalf: return cast_run<S, c10::Half>();
    default: TORCH_CHECK(false, "overlap copy: unsupported dtype ", dst, " (fp32, bf16, fp16)");
  }
}

CastFn cast_fn(at::ScalarType src, at::ScalarType dst) {
  switch (src) {
    case at::kFloat: return cast_to<float>(dst);
    case at::kBFloat16: return cast_to<c10::BFloat16>(dst);
    case at::kHalf: return cast_to<c10::Half>(dst);
    default: TORCH_CHECK(false, "overlap copy: unsupported dtype ", src, " (fp32, bf16, fp16)");
  }
}

// One tensor's column block. `many` is the tensor's data (the contiguous side).
struct Segment {
  char* many;
  int64_t elem_bytes;  // of the tensor
  int64_t col_off;     // first column in flat
  int64_t cols;        // columns (elements per row of flat)
  int64_t data_cols;   // the first data_cols columns of each row hold tensor elements
  int64_t valid;       // tensor elements; the rest of the segment is padding
  int64_t start;       // first job index g: num_rows * col_off
  int64_t stop;        // one past the last: start + num_rows * cols
  CastFn fn;           // tensor -> flat (copy-in) or flat -> tensor (copy-out)
};

// Calls `visit(segment, row, col, len)`, in parallel, for runs that together cover the job:
// columns [col, col + len) of row `row` of the segment.
template <typename Visit>
void for_each_run(const std::vector<Segment>& segs, int64_t total, const Visit& visit) {
  at::parallel_for(0, total, kGrainElems, [&](int64_t begin, int64_t end) {
    // the segment covering `begin` (segments are non-empty and tile [0, total))
    auto it = std::upper_bound(segs.begin(), segs.end(), begin,
                               [](int64_t g, const Segment& s) { return g < s.start; });
    size_t i = static_cast<size_t>(it - segs.begin()) - 1;
    int64_t g = begin;
    while (g < end) {
      while (g >= segs[i].stop) ++i;
      const Segment& s = segs[i];
      const int64_t k = g - s.start;
      const int64_t row = k / s.cols;
      const int64_t col = k - row * s.cols;
      const int64_t len = std::min(s.cols - col, end - g);
      visit(s, row, col, len);
      g += len;
    }
  });
}

struct Job {
  std::vector<Segment> segs;
  int64_t row_stride = 0;  // W
  int64_t total = 0;       // num_rows * W
};

// Tensor elements of a run: the data columns of [col, col + len) in `row`, up to the tensor's
// end. They are tensor elements [k, k + n) with k = row * data_cols + col.
inline int64_t data_in_run(const Segment& s, int64_t row, int64_t col, int64_t len, int64_t* k) {
  *k = row * s.data_cols + col;
  return std::clamp<int64_t>(std::min(s.data_cols - col, s.valid - *k), 0, len);
}

// `flat_type` / `flat_numel`: the flat side's dtype and elements (one buffer, or its rows).
Job make_job(at::ScalarType flat_type, int64_t flat_numel, at::TensorList tensors, c10::IntArrayRef sizes,
             c10::IntArrayRef data_cols, int64_t num_rows, bool into_flat) {
  TORCH_CHECK(num_rows > 0, "overlap copy: num_rows must be positive");
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == static_cast<int64_t>(sizes.size()) &&
                  sizes.size() == data_cols.size(),
              "overlap copy: one size and one data_cols per tensor");
  Job job;
  int64_t col_off = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t size = sizes[i];
    TORCH_CHECK(size >= 0 && size % num_rows == 0, "overlap copy: sizes[", i, "] not a multiple of num_rows");
    const int64_t cols = size / num_rows;
    TORCH_CHECK(data_cols[i] >= 0 && data_cols[i] <= cols, "overlap copy: data_cols[", i, "] outside the segment");
    TORCH_CHECK(t.numel() <= num_rows * data_cols[i], "overlap copy: tensor ", i, " is larger than its segment");
    TORCH_CHECK(t.numel() == 0 || (t.device().is_cpu() && t.is_contiguous()),
                "overlap copy: tensor ", i, " must be a contiguous CPU tensor");
    if (cols > 0) {
      Segment s;
      s.many = t.numel() ? static_cast<char*>(t.data_ptr()) : nullptr;
      s.elem_bytes = t.element_size();
      s.col_off = col_off;
      s.cols = cols;
      s.data_cols = data_cols[i];
      s.valid = t.numel();
      s.start = num_rows * col_off;
      s.stop = s.start + num_rows * cols;
      s.fn = into_flat ? cast_fn(t.scalar_type(), flat_type) : cast_fn(flat_type, t.scalar_type());
      job.segs.push_back(s);
    }
    col_off += cols;
  }
  job.row_stride = col_off;
  job.total = num_rows * col_off;
  TORCH_CHECK(flat_numel == job.total, "overlap copy: flat has ", flat_numel, " elements, the segments ",
              job.total);
  return job;
}

void check_flat(const at::Tensor& flat) {
  TORCH_CHECK(flat.device().is_cpu() && flat.is_contiguous(), "overlap copy: flat must be a contiguous CPU tensor");
}

// Copy-out from rows that need not be one buffer: row r of the flat side starts at rows[r].
void copy_out_from(const std::vector<const char*>& rows, int64_t flat_bytes, const Job& job) {
  if (job.total == 0) return;
  for_each_run(job.segs, job.total, [&](const Segment& s, int64_t row, int64_t col, int64_t len) {
    int64_t k;
    const int64_t n = data_in_run(s, row, col, len, &k);  // padding is not copied out
    if (n > 0) s.fn(rows[row] + (s.col_off + col) * flat_bytes, s.many + k * s.elem_bytes, n);
  });
}

void copy_out(const at::Tensor& flat, at::TensorList outs, c10::IntArrayRef sizes, c10::IntArrayRef data_cols,
              int64_t num_rows) {
  check_flat(flat);
  const Job job = make_job(flat.scalar_type(), flat.numel(), outs, sizes, data_cols, num_rows, /*into_flat=*/false);
  const char* base = static_cast<const char*>(flat.data_ptr());
  std::vector<const char*> rows;
  for (int64_t r = 0; r < num_rows; ++r) rows.push_back(base + r * job.row_stride * flat.element_size());
  copy_out_from(rows, flat.element_size(), job);
}

// copy_out of the rank-major rows `rows[0] | rows[1] | ...` without concatenating them: each row
// holds at least W elements of one dtype (the first W are read).
void copy_out_rows(at::TensorList rows, at::TensorList outs, c10::IntArrayRef sizes, c10::IntArrayRef data_cols) {
  TORCH_CHECK(!rows.empty(), "overlap copy_out_rows: no rows");
  const int64_t num_rows = static_cast<int64_t>(rows.size());
  int64_t width = 0;
  for (size_t i = 0; i < sizes.size(); ++i) width += sizes[i] / num_rows;
  for (const auto& row : rows) {
    check_flat(row);
    TORCH_CHECK(row.scalar_type() == rows[0].scalar_type() && row.numel() >= width,
                "overlap copy_out_rows: every row needs ", width, " elements of one dtype");
  }
  const Job job = make_job(rows[0].scalar_type(), num_rows * width, outs, sizes, data_cols, num_rows, false);
  std::vector<const char*> bases;
  for (const auto& row : rows) bases.push_back(static_cast<const char*>(row.data_ptr()));
  copy_out_from(bases, rows[0].element_size(), job);
}

void copy_in(at::TensorList srcs, c10::IntArrayRef sizes, c10::IntArrayRef data_cols, const at::Tensor& flat,
             int64_t num_rows) {
  check_flat(flat);
  const Job job = make_job(flat.scalar_type(), flat.numel(), srcs, sizes, data_cols, num_rows, /*into_flat=*/true);
  if (job.total == 0) return;
  char* base = static_cast<char*>(flat.data_ptr());
  const int64_t flat_bytes = flat.element_size();
  for_each_run(job.segs, job.total, [&](const Segment& s, int64_t row, int64_t col, int64_t len) {
    char* dst = base + (row * job.row_stride + s.col_off + col) * flat_bytes;
    int64_t k;
    const int64_t n = data_in_run(s, row, col, len, &k);
    if (n > 0) s.fn(s.many + k * s.elem_bytes, dst, n);
    if (n < len) std::memset(dst + n * flat_bytes, 0, (len - n) * flat_bytes);  // all-zero bits: +0.0
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(overlap_cpu, m) {
  m.def("copy_out(Tensor flat, Tensor(a!)[] outs, int[] sizes, int[] data_cols, int num_rows) -> ()", &copy_out);
  m.def("copy_in(Tensor[] srcs, int[] sizes, int[] data_cols, Tensor(a!) flat, int num_rows) -> ()", &copy_in);
  m.def("copy_out_rows(Tensor[] rows, Tensor(a!)[] outs, int[] sizes, int[] data_cols) -> ()", &copy_out_rows);
}
