// Blockwise int8 quantize / dequantize(-accumulate) for CUDA, free of torch headers so CI can
// compile it with the machine's nvcc alone (`nvcc -c -arch=sm_90 quantize_int8.cu`). The format
// and the fp32 expressions are those of overlap/kernels/reference.py
// ([Note: blockwise quantization format]): IEEE division (__fdiv_rn), round-half-even
// (__float2int_rn), multiply and add kept separate (__fmul_rn / __fadd_rn: no FMA contraction),
// so results equal the torch reference bitwise. Bound to Python only with a CUDA torch (the
// Triton kernels serve the same ops there today); these launchers are the C ABI for that binding.
#include <cuda_runtime.h>

#include <cstdint>

namespace overlap {

// One thread block per quantization block; each thread strides over the block's elements.
constexpr int kThreads = 256;

__device__ inline uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

__global__ void quantize_int8_kernel(const float* __restrict__ x, int64_t numel, int block,
                                     int8_t* __restrict__ codes, float* __restrict__ scales) {
  __shared__ uint32_t warp_max[kThreads / 32];
  const int64_t start = static_cast<int64_t>(blockIdx.x) * block;
  const int64_t len = min(static_cast<int64_t>(block), numel - start);
  uint32_t mb = 0;
  for (int i = threadIdx.x; i < len; i += blockDim.x) mb = max(mb, abs_bits(x[start + i]));
  for (int off = 16; off > 0; off >>= 1) mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, off));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = mb;
  __syncthreads();
  if (threadIdx.x < 32) {
    mb = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0u;
    for (int off = 16; off > 0; off >>= 1) mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, off));
    if (threadIdx.x == 0) warp_max[0] = mb;
  }
  __syncthreads();
  mb = warp_max[0];
  const bool finite = mb < 0x7f800000u;  // any Inf/NaN in the block sorts above every finite |x|
  const float scale = finite ? __fdiv_rn(__uint_as_float(mb), 127.0f) : __int_as_float(0x7fc00000);
  const float safe = (finite && scale > 0.0f) ? scale : 1.0f;
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;
  for (int i = threadIdx.x; i < block; i += blockDim.x) {
    const float v = i < len ? x[start + i] : 0.0f;
    int q = finite ? __float2int_rn(__fdiv_rn(v, safe)) : 0;
    q = min(max(q, -127), 127);
    codes[start + i] = static_cast<int8_t>(q);
  }
}

__global__ void dequantize_int8_kernel(const int8_t* __restrict__ codes, const float* __restrict__ scales,
                                       int64_t numel, int block, float* __restrict__ out, bool accumulate) {
  const int64_t start = static_cast<int64_t>(blockIdx.x) * block;
  const int64_t len = min(static_cast<int64_t>(block), numel - start);
  const float s = scales[blockIdx.x];
  for (int i = threadIdx.x; i < len; i += blockDim.x) {
    const float d = __fmul_rn(static_cast<float>(codes[start + i]), s);
    out[start + i] = accumulate ? __fadd_rn(out[start + i], d) : d;
  }
}

}  // namespace overlap

extern "C" {

// codes: num_blocks * block int8; scales: num_blocks fp32; num_blocks = ceil(numel / block).
cudaError_t overlap_quantize_int8(const float* x, int64_t numel, int block, int8_t* codes, float* scales,
                                  cudaStream_t stream) {
  const int64_t num_blocks = (numel + block - 1) / block;
  if (num_blocks == 0) return cudaSuccess;
  overlap::quantize_int8_kernel<<<static_cast<unsigned>(num_blocks), overlap::kThreads, 0, stream>>>(
      x, numel, block, codes, scales);
  return cudaGetLastError();
}

cudaError_t overlap_dequantize_int8(const int8_t* codes, const float* scales, int64_t numel, int block,
                                    float* out, bool accumulate, cudaStream_t stream) {
  const int64_t num_blocks = (numel + block - 1) / block;
  if (num_blocks == 0) return cudaSuccess;
  overlap::dequantize_int8_kernel<<<static_cast<unsigned>(num_blocks), overlap::kThreads, 0, stream>>>(
      codes, scales, numel, block, out, accumulate);
  return cudaGetLastError();
}

}  // extern "C"
