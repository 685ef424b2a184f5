// Bias + GeLU after the MLP's first (column-parallel) linear, which then skips its own bias add, and the backward.
//
// Either GeLU the model's torch path may use: the exact one, x * Phi(x) with Phi the standard normal CDF
// (torch.nn.functional.gelu's default), or with tanh (--openai-gelu) the approximation
// x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) of Megatron's bias_gelu and F.gelu(approximate="tanh"): the fused and
// unfused models compute the same function. The choice is a template parameter, so each kernel has no branch per
// element. Threads run along the columns (coalesced, each holding its bias value) and the grid's y dimension strides
// over rows, so no element needs a division to find its column.

#include "common.cuh"

namespace megalite {
namespace {

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kTanhCubic = 0.044715f;
constexpr int kThreads = 256;

template <bool kTanh>
__device__ __forceinline__ float gelu(float u) {
  if (kTanh) return 0.5f * u * (1.0f + tanhf(kSqrt2OverPi * (u + kTanhCubic * u * u * u)));
  return 0.5f * u * (1.0f + erff(u * kInvSqrt2));
}

// d gelu / du: exact Phi(u) + u * phi(u); tanh (1 + t) / 2 + u / 2 * (1 - t^2) * k * (1 + 3 c u^2)
template <bool kTanh>
__device__ __forceinline__ float gelu_grad(float u) {
  if (kTanh) {
    const float t = tanhf(kSqrt2OverPi * (u + kTanhCubic * u * u * u));
    return 0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kTanhCubic * u * u);
  }
  return 0.5f * (1.0f + erff(u * kInvSqrt2)) + u * kInvSqrt2Pi * expf(-0.5f * u * u);
}

template <typename T, bool kTanh>
__global__ void bias_gelu_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                                         int64_t rows, int64_t cols) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const float b = to_float(bias[col]);
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t i = row * cols + col;
    y[i] = from_float<T>(gelu<kTanh>(to_float(x[i]) + b));
  }
}

template <typename T, bool kTanh>
__global__ void bias_gelu_backward_kernel(const T* __restrict__ grad_y, const T* __restrict__ x,
                                          const T* __restrict__ bias, T* __restrict__ grad_x, int64_t rows,
                                          int64_t cols) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const float b = to_float(bias[col]);
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t i = row * cols + col;
    grad_x[i] = from_float<T>(to_float(grad_y[i]) * gelu_grad<kTanh>(to_float(x[i]) + b));
  }
}

dim3 grid_for(int64_t rows, int64_t cols) {
  return dim3(static_cast<unsigned>((cols + kThreads - 1) / kThreads),
              static_cast<unsigned>(rows < kMaxGridY ? rows : kMaxGridY));
}

template <bool kTanh>
cudaError_t launch_forward(const void* x, const void* bias, void* y, int64_t rows, int64_t cols, DType dtype,
                           cudaStream_t stream) {
  MEGALITE_DISPATCH(dtype, bias_gelu_forward_kernel<T, kTanh><<<grid_for(rows, cols), kThreads, 0, stream>>>(
                               static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(y), rows,
                               cols));
  return cudaGetLastError();
}

template <bool kTanh>
cudaError_t launch_backward(const void* grad_y, const void* x, const void* bias, void* grad_x, int64_t rows,
                            int64_t cols, DType dtype, cudaStream_t stream) {
  MEGALITE_DISPATCH(dtype, bias_gelu_backward_kernel<T, kTanh><<<grid_for(rows, cols), kThreads, 0, stream>>>(
                               static_cast<const T*>(grad_y), static_cast<const T*>(x),
                               static_cast<const T*>(bias), static_cast<T*>(grad_x), rows, cols));
  return cudaGetLastError();
}

}  // namespace

cudaError_t bias_gelu_forward(const void* x, const void* bias, void* y, int64_t rows, int64_t cols, bool tanh,
                              DType dtype, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if ((cols + kThreads - 1) / kThreads > kMaxGridX) return cudaErrorInvalidConfiguration;
  return tanh ? launch_forward<true>(x, bias, y, rows, cols, dtype, stream)
              : launch_forward<false>(x, bias, y, rows, cols, dtype, stream);
}

cudaError_t bias_gelu_backward(const void* grad_y, const void* x, const void* bias, void* grad_x, int64_t rows,
                               int64_t cols, bool tanh, DType dtype, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if ((cols + kThreads - 1) / kThreads > kMaxGridX) return cudaErrorInvalidConfiguration;
  return tanh ? launch_backward<true>(grad_y, x, bias, grad_x, rows, cols, dtype, stream)
              : launch_backward<false>(grad_y, x, bias, grad_x, rows, cols, dtype, stream);
}

}  // namespace megalite
