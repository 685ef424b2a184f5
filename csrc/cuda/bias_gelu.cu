// Bias + GeLU after the MLP's first (column-parallel) linear, which then skips its own bias add, and the backward.
//
// The exact GeLU, x * Phi(x) with Phi the standard normal CDF (torch.nn.functional.gelu's default, which the model's
// torch path uses), not the tanh approximation of Megatron's bias_gelu: the fused and unfused models compute the
// same function. Threads run along the columns (coalesced, each holding its bias value) and the grid's y dimension
// strides over rows, so no element needs a division to find its column.

#include "common.cuh"

namespace megalite {
namespace {

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr int kThreads = 256;

__device__ __forceinline__ float gelu(float u) { return 0.5f * u * (1.0f + erff(u * kInvSqrt2)); }

// d gelu / du = Phi(u) + u * phi(u)
__device__ __forceinline__ float gelu_grad(float u) {
  return 0.5f * (1.0f + erff(u * kInvSqrt2)) + u * kInvSqrt2Pi * expf(-0.5f * u * u);
}

template <typename T>
__global__ void bias_gelu_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                                         int64_t rows, int64_t cols) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const float b = to_float(bias[col]);
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t i = row * cols + col;
    y[i] = from_float<T>(gelu(to_float(x[i]) + b));
  }
}

template <typename T>
__global__ void bias_gelu_backward_kernel(const T* __restrict__ grad_y, const T* __restrict__ x,
                                          const T* __restrict__ bias, T* __restrict__ grad_x, int64_t rows,
                                          int64_t cols) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const float b = to_float(bias[col]);
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t i = row * cols + col;
    grad_x[i] = from_float<T>(to_float(grad_y[i]) * gelu_grad(to_float(x[i]) + b));
  }
}

dim3 grid_for(int64_t rows, int64_t cols) {
  return dim3(static_cast<unsigned>((cols + kThreads - 1) / kThreads),
              static_cast<unsigned>(rows < kMaxGridY ? rows : kMaxGridY));
}

}  // namespace

cudaError_t bias_gelu_forward(const void* x, const void* bias, void* y, int64_t rows, int64_t cols, DType dtype,
                              cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if ((cols + kThreads - 1) / kThreads > kMaxGridX) return cudaErrorInvalidConfiguration;
  MEGALITE_DISPATCH(dtype, bias_gelu_forward_kernel<T><<<grid_for(rows, cols), kThreads, 0, stream>>>(
                               static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(y), rows,
                               cols));
  return cudaGetLastError();
}

cudaError_t bias_gelu_backward(const void* grad_y, const void* x, const void* bias, void* grad_x, int64_t rows,
                               int64_t cols, DType dtype, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if ((cols + kThreads - 1) / kThreads > kMaxGridX) return cudaErrorInvalidConfiguration;
  MEGALITE_DISPATCH(dtype, bias_gelu_backward_kernel<T><<<grid_for(rows, cols), kThreads, 0, stream>>>(
                               static_cast<const T*>(grad_y), static_cast<const T*>(x),
                               static_cast<const T*>(bias), static_cast<T*>(grad_x), rows, cols));
  return cudaGetLastError();
}

}  // namespace megalite
