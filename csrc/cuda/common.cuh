// Shared device helpers of the fused kernels: dtype conversion, warp and block reductions, dtype dispatch.
//
// Conversions go through the explicit intrinsics (__bfloat162float, __float2half_rn, ...) because torch builds CUDA
// sources with -D__CUDA_NO_HALF_CONVERSIONS__ and -D__CUDA_NO_BFLOAT16_CONVERSIONS__, which remove the implicit ones;
// tests/kernels/test_cuda_compile.py compiles with the same defines.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fused_kernels.h"

namespace megalite {

template <typename T>
__device__ __forceinline__ float to_float(T value);
template <>
__device__ __forceinline__ float to_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 value) { return __bfloat162float(value); }
template <>
__device__ __forceinline__ float to_float<__half>(__half value) { return __half2float(value); }

template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) { return __float2bfloat16_rn(value); }
template <>
__device__ __forceinline__ __half from_float<__half>(float value) { return __float2half_rn(value); }

constexpr int kWarpSize = 32;

__device__ __forceinline__ float warp_sum(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__device__ __forceinline__ float warp_max(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

// Sum (or max) over the block, returned to every thread. blockDim.x must be a multiple of 32 (at most 1024);
// scratch is 32 floats of shared memory, reusable right after the call (the leading barrier protects the previous
// reduction's readers).
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  value = warp_sum(value);
  __syncthreads();
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  return warp_sum(lane < static_cast<int>(blockDim.x) / kWarpSize ? scratch[lane] : 0.0f);
}

__device__ __forceinline__ float block_max(float value, float* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  value = warp_max(value);
  __syncthreads();
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  return warp_max(lane < static_cast<int>(blockDim.x) / kWarpSize ? scratch[lane] : -INFINITY);
}

// Threads for one block per row of `cols` elements: at least 4 elements per thread, 32 to 256 threads (a multiple of
// 32, as block_sum needs). Rows are the grid's x dimension (up to 2^31 - 1 of them).
inline int row_threads(int64_t cols) {
  int threads = kWarpSize;
  while (threads < 256 && 4 * static_cast<int64_t>(threads) < cols) threads *= 2;
  return threads;
}

constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridY = 65535;

}  // namespace megalite

// Runs the statement with T bound to the element type of `dtype` (float, __nv_bfloat16 or __half); an unknown dtype
// returns cudaErrorInvalidValue from the enclosing launcher.
#define MEGALITE_DISPATCH(dtype, ...)                       \
  switch (dtype) {                                          \
    case ::megalite::DType::kFloat32: {                     \
      using T = float;                                      \
      __VA_ARGS__;                                          \
      break;                                                \
    }                                                       \
    case ::megalite::DType::kBFloat16: {                    \
      using T = __nv_bfloat16;                              \
      __VA_ARGS__;                                          \
      break;                                                \
    }                                                       \
    case ::megalite::DType::kFloat16: {                     \
      using T = __half;                                     \
      __VA_ARGS__;                                          \
      break;                                                \
    }                                                       \
    default:                                                \
      return cudaErrorInvalidValue;                         \
  }
