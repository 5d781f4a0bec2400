// Blockwise quantize / dequantize(-accumulate) for the CPU, parallel over blocks.
// The definition lives in overlap/kernels/reference.py ([Note: blockwise quantization format]);
// these loops compute the same fp32 expressions in the same order (built with
// -ffp-contract=off: no fused multiply-add), so round-to-nearest results are bitwise equal.
//
// Registered as torch ops (torch.ops.overlap_cpu.*) rather than a pybind module: the lean
// headers below compile in about half the time of <torch/extension.h>.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kFmtInt = 0;
constexpr int64_t kFmtFp8 = 1;
constexpr float kFp8Max = 448.0f;
// Blocks per parallel task: enough work (~64K elements) to amortise the task overhead.
constexpr int64_t kGrainElems = 1 << 16;
// Blocks are processed in chunks of this many elements through a stack buffer.
constexpr int64_t kChunk = 1024;
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23

inline uint32_t abs_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b & 0x7fffffffu;
}

inline float from_bits(uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

// float -> float8_e4m3fn bits, round-to-nearest-even: c10's fp8e4m3fn_from_fp32_value with its
// branches turned into selects so that the loop vectorises (bitwise equal; tests check it).
inline uint8_t fp8_e4m3fn_bits(float f) {
  constexpr uint32_t kMax = UINT32_C(1087) << 20;       // 480: rounds past 448, becomes NaN
  constexpr uint32_t kDenormMask = UINT32_C(141) << 23;  // adding 2^14 aligns subnormal bits
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t sign = bits & UINT32_C(0x80000000);
  bits ^= sign;
  const uint32_t denorm = abs_bits(from_bits(bits) + from_bits(kDenormMask)) - kDenormMask;
  const uint32_t mant_odd = (bits >> 20) & 1u;
  const uint32_t normal = (bits + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + mant_odd) >> 20;
  uint32_t result = bits < (UINT32_C(121) << 23) ? denorm : normal;
  result = bits >= kMax ? 0x7Fu : result;
  return static_cast<uint8_t>(result | (sign >> 24));
}

inline float clampf(float v, float lo, float hi) { return std::min(std::max(v, lo), hi); }

int64_t grain_blocks(int64_t block) { return std::max<int64_t>(1, kGrainElems / block); }

// Quantizes blocks [b0, b1). Inlined into one copy per instruction set (below); the source and
// hence the IEEE results are the same in each.
template <typename scalar_t>
__attribute__((always_inline)) inline void quantize_blocks(const scalar_t* x, int64_t numel, int64_t bits,
                                                           int64_t block, int64_t fmt, const float* noise,
                                                           void* codes_out, float* scales, int64_t b0,
                                                           int64_t b1) {
  const float qmax = fmt == kFmtFp8 ? kFp8Max : static_cast<float>((1 << (bits - 1)) - 1);
  float y[kChunk];  // one chunk of a block, in fp32
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * block;
    const int64_t len = std::min(block, numel - start);
    const scalar_t* xb = x + start;
    // |x| as bits: for non-negative floats integer order is float order, and any Inf/NaN
    // compares above 0x7f800000 - one integer max reduction finds both (vectorises).
    uint32_t mb = 0;
    for (int64_t i = 0; i < len; ++i) mb = std::max(mb, abs_bits(static_cast<float>(xb[i])));
    const bool finite = mb < 0x7f800000u;
    const float amax = from_bits(mb);
    const float scale = finite ? amax / qmax : std::numeric_limits<float>::quiet_NaN();
    const float safe = (finite && scale > 0.0f) ? scale : 1.0f;
    scales[b] = scale;
    for (int64_t c0 = 0; c0 < block; c0 += kChunk) {
      const int64_t clen = std::min<int64_t>(kChunk, block - c0);
      const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(clen, len - c0));
      const scalar_t* xc = xb + c0;
      // Branch-free loops (they vectorise); the padded tail and non-finite blocks are zeroed.
      for (int64_t i = 0; i < valid; ++i) y[i] = static_cast<float>(xc[i]) / safe;
      for (int64_t i = valid; i < clen; ++i) y[i] = 0.0f;
      if (!finite) std::fill(y, y + clen, 0.0f);
      if (fmt == kFmtFp8) {
        uint8_t* out = static_cast<uint8_t*>(codes_out) + start + c0;
        for (int64_t i = 0; i < clen; ++i) out[i] = fp8_e4m3fn_bits(clampf(y[i], -kFp8Max, kFp8Max));
        continue;
      }
      if (noise != nullptr) {
        const float* u = noise + start + c0;
        for (int64_t i = 0; i < clen; ++i) {
          // floor(v) for |v| < 2^22 (|v| <= qmax + 1 here): round to nearest, step down if above.
          const float v = y[i] + u[i];
          const float r = (v + kRoundMagic) - kRoundMagic;
          y[i] = clampf(r > v ? r - 1.0f : r, -qmax, qmax);
        }
      } else {
        // Round half to even, as torch.round: adding and subtracting 1.5 * 2^23 leaves the
        // integer nearest to y in the current (default: to-nearest-even) rounding mode, for
        // |y| < 2^22 (|y| <= 2 * qmax here). Same result as std::nearbyint, and it vectorises
        // on plain SSE2.
        for (int64_t i = 0; i < clen; ++i) {
          const float r = (y[i] + kRoundMagic) - kRoundMagic;
          y[i] = clampf(r, -qmax, qmax);
        }
      }
      if (bits == 8) {
        int8_t* out = static_cast<int8_t*>(codes_out) + start + c0;
        for (int64_t i = 0; i < clen; ++i) out[i] = static_cast<int8_t>(static_cast<int32_t>(y[i]));
      } else {
        uint8_t* out = static_cast<uint8_t*>(codes_out) + (start + c0) / 2;
        for (int64_t i = 0; i < clen / 2; ++i) {
          const int32_t lo = static_cast<int32_t>(y[2 * i]) + 8;
          const int32_t hi = static_cast<int32_t>(y[2 * i + 1]) + 8;
          out[i] = static_cast<uint8_t>(lo | (hi << 4));
        }
      }
    }
  }
}

// Wider vectors where the CPU has them, picked at run time (the cached .so stays portable).
// No FMA is enabled and -ffp-contract=off holds, so both copies round identically.
template <typename scalar_t>
__attribute__((target("avx2"))) void quantize_blocks_avx2(const scalar_t* x, int64_t numel, int64_t bits,
                                                          int64_t block, int64_t fmt, const float* noise,
                                                          void* codes_out, float* scales, int64_t b0, int64_t b1) {
  quantize_blocks<scalar_t>(x, numel, bits, block, fmt, noise, codes_out, scales, b0, b1);
}

template <typename scalar_t>
void quantize_blocks_base(const scalar_t* x, int64_t numel, int64_t bits, int64_t block, int64_t fmt,
                          const float* noise, void* codes_out, float* scales, int64_t b0, int64_t b1) {
  quantize_blocks<scalar_t>(x, numel, bits, block, fmt, noise, codes_out, scales, b0, b1);
}

template <typename scalar_t>
void quantize_impl(const scalar_t* x, int64_t numel, int64_t bits, int64_t block, int64_t fmt,
                   const float* noise, void* codes_out, float* scales) {
  const int64_t nb = (numel + block - 1) / block;
  // OVERLAP_CPU_BASELINE=1 forces the baseline copy (tests compare both with the reference).
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && std::getenv("OVERLAP_CPU_BASELINE") == nullptr;
  const auto run = has_avx2 ? &quantize_blocks_avx2<scalar_t> : &quantize_blocks_base<scalar_t>;
  at::parallel_for(0, nb, grain_blocks(block), [&](int64_t b0, int64_t b1) {
    run(x, numel, bits, block, fmt, noise, codes_out, scales, b0, b1);
  });
}

// Error feedback, fused: t = x + r (fp32), codes = quantize(t), r = t - decode(codes), one block
// at a time while it is in cache (one pass over memory instead of four). The same fp32 operations
// as the reference composition (overlap/compression/feedback.py), so the same bits; a non-finite
// block (scale NaN, every r NaN) leaves r = 0, as the composition's `finite_residual` does.
template <typename scalar_t>
__attribute__((always_inline)) inline void feedback_blocks(const scalar_t* x, float* r, int64_t numel, int64_t bits,
                                                           int64_t block, int64_t fmt, const float* noise,
                                                           void* codes_out, float* scales,
                                                           const float* fp8_table, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * block;
    const int64_t len = std::min(block, numel - start);
    float* rb = r + start;
    const scalar_t* xb = x + start;
    for (int64_t i = 0; i < len; ++i) rb[i] = static_cast<float>(xb[i]) + rb[i];
    quantize_blocks<float>(r, numel, bits, block, fmt, noise, codes_out, scales, b, b + 1);
    const float s = scales[b];
    if (fmt == kFmtFp8) {
      const uint8_t* c = static_cast<const uint8_t*>(codes_out) + start;
      for (int64_t i = 0; i < len; ++i) rb[i] = rb[i] - fp8_table[c[i]] * s;
    } else if (bits == 8) {
      const int8_t* c = static_cast<const int8_t*>(codes_out) + start;
      for (int64_t i = 0; i < len; ++i) rb[i] = rb[i] - static_cast<float>(c[i]) * s;
    } else {
      const uint8_t* c = static_cast<const uint8_t*>(codes_out) + start / 2;
      for (int64_t i = 0; i < len; ++i) {
        const int32_t nib = (i & 1) ? (c[i / 2] >> 4) : (c[i / 2] & 0xF);
        rb[i] = rb[i] - static_cast<float>(nib - 8) * s;
      }
    }
    if (std::isnan(s)) std::fill(rb, rb + len, 0.0f);  // a non-finite block leaves no residual
  }
}

template <typename scalar_t>
__attribute__((target("avx2"))) void feedback_blocks_avx2(const scalar_t* x, float* r, int64_t numel, int64_t bits,
                                                          int64_t block, int64_t fmt, const float* noise,
                                                          void* codes_out, float* scales, const float* table,
                                                          int64_t b0, int64_t b1) {
  feedback_blocks<scalar_t>(x, r, numel, bits, block, fmt, noise, codes_out, scales, table, b0, b1);
}

template <typename scalar_t>
void feedback_blocks_base(const scalar_t* x, float* r, int64_t numel, int64_t bits, int64_t block, int64_t fmt,
                          const float* noise, void* codes_out, float* scales, const float* table, int64_t b0,
                          int64_t b1) {
  feedback_blocks<scalar_t>(x, r, numel, bits, block, fmt, noise, codes_out, scales, table, b0, b1);
}

// Error feedback with an int8 residual ([Note: error feedback residual] in feedback.py), fused:
// r = decode(res_codes) (int8 blockwise, the codec's block), t = x + r, codes = quantize(t),
// r' = t - decode(codes), (res_codes, res_scales) = quantize_int8(r'), one block at a time through
// a block-sized buffer: one pass over memory instead of the composition's three kernels and two
// full-size fp32 temporaries. The same fp32 operations in the same order as the composition
// (dequantize_blockwise, quantize_feedback_blockwise, quantize_blockwise), so the same bits.
template <typename scalar_t>
__attribute__((always_inline)) inline void feedback_int8res_blocks(const scalar_t* x, int8_t* res_codes,
                                                                   float* res_scales, int64_t numel, int64_t bits,
                                                                   int64_t block, int64_t fmt, const float* noise,
                                                                   void* codes_out, float* scales,
                                                                   const float* fp8_table, float* t, int64_t b0,
                                                                   int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * block;
    const int64_t len = std::min(block, numel - start);
    const scalar_t* xb = x + start;
    int8_t* rc = res_codes + start;
    const float rs = res_scales[b];
    for (int64_t i = 0; i < len; ++i) t[i] = static_cast<float>(xb[i]) + static_cast<float>(rc[i]) * rs;
    uint8_t* cb = static_cast<uint8_t*>(codes_out) + (bits == 4 ? start / 2 : start);
    quantize_blocks<float>(t, len, bits, block, fmt, noise == nullptr ? nullptr : noise + start, cb, scales + b, 0, 1);
    const float s = scales[b];
    if (fmt == kFmtFp8) {
      for (int64_t i = 0; i < len; ++i) t[i] = t[i] - fp8_table[cb[i]] * s;
    } else if (bits == 8) {
      const int8_t* c = reinterpret_cast<const int8_t*>(cb);
      for (int64_t i = 0; i < len; ++i) t[i] = t[i] - static_cast<float>(c[i]) * s;
    } else {
      for (int64_t i = 0; i < len; ++i) {
        const int32_t nib = (i & 1) ? (cb[i / 2] >> 4) : (cb[i / 2] & 0xF);
        t[i] = t[i] - static_cast<float>(nib - 8) * s;
      }
    }
    if (std::isnan(s)) std::fill(t, t + len, 0.0f);  // a non-finite block leaves no residual
    quantize_blocks<float>(t, len, 8, block, kFmtInt, nullptr, rc, res_scales + b, 0, 1);
  }
}

template <typename scalar_t>
__attribute__((target("avx2"))) void feedback_int8res_blocks_avx2(const scalar_t* x, int8_t* rc, float* rs,
                                                                  int64_t numel, int64_t bits, int64_t block,
                                                                  int64_t fmt, const float* noise, void* codes_out,
                                                                  float* scales, const float* table, float* t,
                                                                  int64_t b0, int64_t b1) {
  feedback_int8res_blocks<scalar_t>(x, rc, rs, numel, bits, block, fmt, noise, codes_out, scales, table, t, b0, b1);
}

template <typename scalar_t>
void feedback_int8res_blocks_base(const scalar_t* x, int8_t* rc, float* rs, int64_t numel, int64_t bits,
                                  int64_t block, int64_t fmt, const float* noise, void* codes_out, float* scales,
                                  const float* table, float* t, int64_t b0, int64_t b1) {
  feedback_int8res_blocks<scalar_t>(x, rc, rs, numel, bits, block, fmt, noise, codes_out, scales, table, t, b0, b1);
}

void fill_fp8_table(float* table) {
  for (int i = 0; i < 256; ++i) {
    table[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  }
}

template <typename out_t>
void dequantize_impl(const void* codes, const float* scales, int64_t numel, int64_t bits,
                     int64_t block, int64_t fmt, out_t* out, bool accumulate) {
  const int64_t nb = (numel + block - 1) / block;
  // e4m3fn has 256 bit patterns: decode through a table instead of bit manipulation per element.
  float fp8_table[256];
  if (fmt == kFmtFp8) {
    for (int i = 0; i < 256; ++i) {
      fp8_table[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    }
  }
  at::parallel_for(0, nb, grain_blocks(block), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * block;
      const int64_t len = std::min(block, numel - start);
      const float s = scales[b];
      out_t* o = out + start;
      auto store = [&](int64_t i, float d) {
        o[i] = accumulate ? static_cast<out_t>(static_cast<float>(o[i]) + d) : static_cast<out_t>(d);
      };
      if (fmt == kFmtFp8) {
        const uint8_t* c = static_cast<const uint8_t*>(codes) + start;
        for (int64_t i = 0; i < len; ++i) store(i, fp8_table[c[i]] * s);
      } else if (bits == 8) {
        const int8_t* c = static_cast<const int8_t*>(codes) + start;
        for (int64_t i = 0; i < len; ++i) store(i, static_cast<float>(c[i]) * s);
      } else {
        const uint8_t* c = static_cast<const uint8_t*>(codes) + start / 2;
        for (int64_t i = 0; i < len / 2; ++i) {
          store(2 * i, static_cast<float>(static_cast<int32_t>(c[i] & 0xF) - 8) * s);
          store(2 * i + 1, static_cast<float>(static_cast<int32_t>(c[i] >> 4) - 8) * s);
        }
        if (len & 1) store(len - 1, static_cast<float>(static_cast<int32_t>(c[len / 2] & 0xF) - 8) * s);
      }
    }
  });
}

void check_args(int64_t bits, int64_t block, int64_t fmt) {
  TORCH_CHECK(fmt == kFmtInt || fmt == kFmtFp8, "overlap quantize: unknown format ", fmt);
  TORCH_CHECK(bits == 8 || (bits == 4 && fmt == kFmtInt), "overlap quantize: bits must be 8, or 4 for int");
  TORCH_CHECK(block > 0 && (bits == 8 || block % 2 == 0), "overlap quantize: bad block size ", block);
}

// Output buffers of a quantization of x: (codes, fp32 scales), one scale per block.
std::tuple<at::Tensor, at::Tensor> empty_codes(const at::Tensor& x, int64_t bits, int64_t block, int64_t fmt) {
  const int64_t nb = (x.numel() + block - 1) / block;
  const int64_t ncodes = bits == 4 ? nb * block / 2 : nb * block;
  auto codes = at::empty({ncodes}, x.options().dtype(bits == 8 && fmt == kFmtInt ? at::kChar : at::kByte));
  auto scales = at::empty({nb}, x.options().dtype(at::kFloat));
  return {codes, scales};
}

// The stochastic-rounding uniforms, checked; nullptr for round-to-nearest.
const float* noise_ptr(const std::optional<at::Tensor>& noise, int64_t nb, int64_t block, int64_t fmt) {
  if (!noise.has_value()) return nullptr;
  TORCH_CHECK(fmt == kFmtInt, "overlap quantize: stochastic rounding is for int formats");
  TORCH_CHECK(noise->scalar_type() == at::kFloat && noise->is_contiguous() && noise->numel() == nb * block,
              "overlap quantize: noise must be contiguous fp32 with num_blocks * block elements");
  return noise->data_ptr<float>();
}

std::tuple<at::Tensor, at::Tensor> quantize_blockwise(const at::Tensor& x, int64_t bits, int64_t block,
                                                      int64_t fmt, const std::optional<at::Tensor>& noise) {
  check_args(bits, block, fmt);
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "overlap quantize: x must be a contiguous CPU tensor");
  const int64_t numel = x.numel();
  const int64_t nb = (numel + block - 1) / block;
  auto [codes, scales] = empty_codes(x, bits, block, fmt);
  const float* u = noise_ptr(noise, nb, block, fmt);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "overlap_quantize", [&] {
    quantize_impl<scalar_t>(x.data_ptr<scalar_t>(), numel, bits, block, fmt, u, codes.data_ptr(),
                            scales.data_ptr<float>());
  });
  return {codes, scales};
}

void dequantize_blockwise(const at::Tensor& codes, const at::Tensor& scales, int64_t bits, int64_t block,
                          int64_t numel, const at::Tensor& out, bool accumulate, int64_t fmt) {
  check_args(bits, block, fmt);
  const int64_t nb = (numel + block - 1) / block;
  TORCH_CHECK(codes.device().is_cpu() && codes.is_contiguous() && codes.element_size() == 1,
              "overlap dequantize: codes must be a contiguous CPU byte tensor");
  TORCH_CHECK(codes.numel() == (bits == 4 ? nb * block / 2 : nb * block), "overlap dequantize: codes size");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == nb,
              "overlap dequantize: scales must be contiguous fp32 with num_blocks elements");
  TORCH_CHECK(out.is_contiguous() && out.numel() == numel && out.device().is_cpu(),
              "overlap dequantize: out must be contiguous on CPU with numel elements");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "overlap_dequantize", [&] {
    dequantize_impl<scalar_t>(codes.data_ptr(), scales.data_ptr<float>(), numel, bits, block, fmt,
                              out.data_ptr<scalar_t>(), accumulate);
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_feedback_blockwise(const at::Tensor& x, const at::Tensor& residual,
                                                               int64_t bits, int64_t block, int64_t fmt,
                                                               const std::optional<at::Tensor>& noise) {
  check_args(bits, block, fmt);
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "overlap quantize_feedback: x must be a contiguous CPU tensor");
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.numel() == x.numel() &&
                  residual.device().is_cpu(),
              "overlap quantize_feedback: residual must be contiguous fp32 on CPU with x's numel");
  const int64_t numel = x.numel();
  const int64_t nb = (numel + block - 1) / block;
  auto [codes, scales] = empty_codes(x, bits, block, fmt);
  const float* u = noise_ptr(noise, nb, block, fmt);
  float table[256];
  if (fmt == kFmtFp8) fill_fp8_table(table);
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && std::getenv("OVERLAP_CPU_BASELINE") == nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "overlap_quantize_feedback", [&] {
    const auto run = has_avx2 ? &feedback_blocks_avx2<scalar_t> : &feedback_blocks_base<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    float* rp = residual.data_ptr<float>();
    void* cp = codes.data_ptr();
    float* sp = scales.data_ptr<float>();
    at::parallel_for(0, nb, grain_blocks(block), [&](int64_t b0, int64_t b1) {
      run(xp, rp, numel, bits, block, fmt, u, cp, sp, table, b0, b1);
    });
  });
  return {codes, scales};
}

std::tuple<at::Tensor, at::Tensor> quantize_feedback_int8res_blockwise(
    const at::Tensor& x, const at::Tensor& res_codes, const at::Tensor& res_scales, int64_t bits, int64_t block,
    int64_t fmt, const std::optional<at::Tensor>& noise) {
  check_args(bits, block, fmt);
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "overlap quantize_feedback_int8res: x must be a contiguous CPU tensor");
  const int64_t numel = x.numel();
  const int64_t nb = (numel + block - 1) / block;
  TORCH_CHECK(res_codes.scalar_type() == at::kChar && res_codes.is_contiguous() && res_codes.numel() == nb * block &&
                  res_codes.device().is_cpu(),
              "overlap quantize_feedback_int8res: res_codes must be contiguous int8 on CPU, num_blocks * block");
  TORCH_CHECK(res_scales.scalar_type() == at::kFloat && res_scales.is_contiguous() && res_scales.numel() == nb &&
                  res_scales.device().is_cpu(),
              "overlap quantize_feedback_int8res: res_scales must be contiguous fp32 on CPU, num_blocks");
  auto [codes, scales] = empty_codes(x, bits, block, fmt);
  const float* u = noise_ptr(noise, nb, block, fmt);
  float table[256];
  if (fmt == kFmtFp8) fill_fp8_table(table);
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && std::getenv("OVERLAP_CPU_BASELINE") == nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "overlap_quantize_feedback_int8res", [&] {
    const auto run = has_avx2 ? &feedback_int8res_blocks_avx2<scalar_t> : &feedback_int8res_blocks_base<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    int8_t* rcp = res_codes.data_ptr<int8_t>();
    float* rsp = res_scales.data_ptr<float>();
    void* cp = codes.data_ptr();
    float* sp = scales.data_ptr<float>();
    at::parallel_for(0, nb, grain_blocks(block), [&](int64_t b0, int64_t b1) {
      std::vector<float> t(static_cast<size_t>(block));  // one block of x + r, in fp32
      run(xp, rcp, rsp, numel, bits, block, fmt, u, cp, sp, table, t.data(), b0, b1);
    });
  });
  return {codes, scales};
}

// For tests: the fp8 bit conversion above applied elementwise (compared with torch's cast).
at::Tensor fp8_e4m3fn_cast(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(), "fp32 CPU tensor");
  auto out = at::empty(x.sizes(), x.options().dtype(at::kByte));
  const float* src = x.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < x.numel(); ++i) dst[i] = fp8_e4m3fn_bits(src[i]);
  return out;
}

}  // namespace

TORCH_LIBRARY(overlap_cpu, m) {
  m.def("quantize_blockwise(Tensor x, int bits, int block, int fmt, Tensor? noise) -> (Tensor, Tensor)",
        &quantize_blockwise);
  m.def("dequantize_blockwise(Tensor codes, Tensor scales, int bits, int block, int numel, Tensor(a!) out, "
        "bool accumulate, int fmt) -> ()",
        &dequantize_blockwise);
  m.def("quantize_feedback_blockwise(Tensor x, Tensor(a!) residual, int bits, int block, int fmt, Tensor? noise) "
        "-> (Tensor, Tensor)",
        &quantize_feedback_blockwise);
  m.def("quantize_feedback_int8res_blockwise(Tensor x, Tensor(a!) res_codes, Tensor(b!) res_scales, int bits, "
        "int block, int fmt, Tensor? noise) -> (Tensor, Tensor)",
        &quantize_feedback_int8res_blockwise);
  m.def("fp8_e4m3fn_cast(Tensor x) -> Tensor", &fp8_e4m3fn_cast);
}
