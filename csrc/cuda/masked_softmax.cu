// Scaled upper-triangular (causal) masked softmax, Megatron's fused attention softmax, and its backward.
//
// One block per row of scores: row r is query position i = r % sq, which sees keys 0..i. Forward makes three
// passes over the visible part of the row (max, sum of exponentials, write), reading the same few KiB each time, so
// the second and third passes hit L1/L2; the masked part is only written (zeros), never read. Unlike a masked_fill
// followed by a softmax this reads the scores once from memory and writes the probabilities once.

#include "common.cuh"

namespace megalite {
namespace {

template <typename T>
__global__ void masked_softmax_forward_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t sq, int64_t sk,
                                              float scale) {
  __shared__ float scratch[kWarpSize];
  const int64_t row = blockIdx.x;
  const int64_t visible = min(row % sq + 1, sk);
  const T* x_row = x + row * sk;
  T* y_row = y + row * sk;

  float row_max = -INFINITY;
  for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) row_max = fmaxf(row_max, to_float(x_row[j]) * scale);
  row_max = block_max(row_max, scratch);

  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) sum += expf(to_float(x_row[j]) * scale - row_max);
  sum = block_sum(sum, scratch);

  for (int64_t j = threadIdx.x; j < sk; j += blockDim.x) {
    const float p = j < visible ? expf(to_float(x_row[j]) * scale - row_max) / sum : 0.0f;
    y_row[j] = from_float<T>(p);
  }
}

template <typename T>
__global__ void masked_softmax_backward_kernel(const T* __restrict__ grad_y, const T* __restrict__ y,
                                               T* __restrict__ grad_x, int64_t sq, int64_t sk, float scale) {
  __shared__ float scratch[kWarpSize];
  const int64_t row = blockIdx.x;
  const int64_t visible = min(row % sq + 1, sk);
  const int64_t offset = row * sk;

  float dot = 0.0f;
  for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) {
    dot += to_float(grad_y[offset + j]) * to_float(y[offset + j]);
  }
  dot = block_sum(dot, scratch);

  for (int64_t j = threadIdx.x; j < sk; j += blockDim.x) {
    float g = 0.0f;   // masked keys: y is 0, so is their gradient
    if (j < visible) g = scale * to_float(y[offset + j]) * (to_float(grad_y[offset + j]) - dot);
    grad_x[offset + j] = from_float<T>(g);
  }
}

}  // namespace

cudaError_t masked_softmax_forward(const void* x, void* y, int64_t batches, int64_t sq, int64_t sk, float scale,
                                   DType dtype, cudaStream_t stream) {
  const int64_t rows = batches * sq;
  if (rows == 0 || sk == 0) return cudaSuccess;
  if (rows > kMaxGridX) return cudaErrorInvalidConfiguration;
  const int threads = row_threads(sk);
  MEGALITE_DISPATCH(dtype, masked_softmax_forward_kernel<T><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
                               static_cast<const T*>(x), static_cast<T*>(y), sq, sk, scale));
  return cudaGetLastError();
}

cudaError_t masked_softmax_backward(const void* grad_y, const void* y, void* grad_x, int64_t batches, int64_t sq,
                                    int64_t sk, float scale, DType dtype, cudaStream_t stream) {
  const int64_t rows = batches * sq;
  if (rows == 0 || sk == 0) return cudaSuccess;
  if (rows > kMaxGridX) return cudaErrorInvalidConfiguration;
  const int threads = row_threads(sk);
  MEGALITE_DISPATCH(dtype, masked_softmax_backward_kernel<T><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
                               static_cast<const T*>(grad_y), static_cast<const T*>(y), static_cast<T*>(grad_x),
                               sq, sk, scale));
  return cudaGetLastError();
}

}  // namespace megalite
