// LayerNorm and RMSNorm over the last dimension, forward and backward, one template for both (kRMS: no centering,
// no bias).
//
// Forward: one block per row; the mean and the variance are two passes (sum, then the sum of squared deviations
// from the mean: no cancellation, unlike E[x^2] - E[x]^2), the row being re-read from L1/L2. Backward, with
// x_hat = (x - mean) * rstd and g = grad_y * weight:
//   grad_x = rstd * (g - mean(g) - x_hat * mean(g * x_hat))      (RMSNorm: without the mean(g) term)
// one block per row again; the parameter gradients sum grad_y * x_hat (and grad_y) over rows in two stages, chunks of
// rows into an fp32 workspace and then the chunks, so that every thread reads along a row (coalesced) and no atomics
// make the result depend on scheduling.

#include "common.cuh"

namespace megalite {
namespace {

constexpr int kColumnThreads = 256;

template <typename T, bool kRMS>
__global__ void norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias,
                                    T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                    int64_t cols, float eps) {
  __shared__ float scratch[kWarpSize];
  const int64_t row = blockIdx.x;
  const T* x_row = x + row * cols;
  T* y_row = y + row * cols;

  float mean = 0.0f;
  if (!kRMS) {
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) sum += to_float(x_row[j]);
    mean = block_sum(sum, scratch) / static_cast<float>(cols);
  }
  float squares = 0.0f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float centered = to_float(x_row[j]) - mean;
    squares += centered * centered;
  }
  const float rstd = rsqrtf(block_sum(squares, scratch) / static_cast<float>(cols) + eps);

  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    float value = (to_float(x_row[j]) - mean) * rstd * to_float(weight[j]);
    if (!kRMS && bias != nullptr) value += to_float(bias[j]);
    y_row[j] = from_float<T>(value);
  }
  if (threadIdx.x == 0) {
    if (!kRMS) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

template <typename T, bool kRMS>
__global__ void norm_backward_input_kernel(const T* __restrict__ grad_y, const T* __restrict__ x,
                                           const T* __restrict__ weight, const float* __restrict__ mean_in,
                                           const float* __restrict__ rstd_in, T* __restrict__ grad_x, int64_t cols) {
  __shared__ float scratch[kWarpSize];
  const int64_t row = blockIdx.x;
  const int64_t offset = row * cols;
  const float mean = kRMS ? 0.0f : mean_in[row];
  const float rstd = rstd_in[row];

  float sum_g = 0.0f, sum_g_xhat = 0.0f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float g = to_float(grad_y[offset + j]) * to_float(weight[j]);
    sum_g += g;
    sum_g_xhat += g * (to_float(x[offset + j]) - mean) * rstd;
  }
  const float mean_g = kRMS ? 0.0f : block_sum(sum_g, scratch) / static_cast<float>(cols);
  const float mean_g_xhat = block_sum(sum_g_xhat, scratch) / static_cast<float>(cols);

  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float g = to_float(grad_y[offset + j]) * to_float(weight[j]);
    const float x_hat = (to_float(x[offset + j]) - mean) * rstd;
    grad_x[offset + j] = from_float<T>(rstd * (g - mean_g - x_hat * mean_g_xhat));
  }
}

// Stage 1: chunk c (blockIdx.y) of rows -> workspace[c][col] = sum grad_y * x_hat, and (with a bias) the sums of
// grad_y at workspace[chunks + c][col].
template <typename T, bool kRMS>
__global__ void norm_backward_params_kernel(const T* __restrict__ grad_y, const T* __restrict__ x,
                                            const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                                            float* __restrict__ workspace, int64_t rows, int64_t cols,
                                            bool with_bias) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const int64_t chunks = gridDim.y, chunk = blockIdx.y;
  const int64_t per_chunk = (rows + chunks - 1) / chunks;
  const int64_t first = chunk * per_chunk, last = min(rows, first + per_chunk);
  float sum_weight = 0.0f, sum_bias = 0.0f;
  for (int64_t row = first; row < last; ++row) {
    const float g = to_float(grad_y[row * cols + col]);
    const float x_hat = (to_float(x[row * cols + col]) - (kRMS ? 0.0f : mean_in[row])) * rstd_in[row];
    sum_weight += g * x_hat;
    sum_bias += g;
  }
  workspace[chunk * cols + col] = sum_weight;
  if (with_bias) workspace[(chunks + chunk) * cols + col] = sum_bias;
}

// Stage 2: out[col] = sum over chunks of workspace[chunk][col].
__global__ void sum_chunks_kernel(const float* __restrict__ workspace, float* __restrict__ out, int64_t chunks,
                                  int64_t cols) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float sum = 0.0f;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) sum += workspace[chunk * cols + col];
  out[col] = sum;
}

template <typename T, bool kRMS>
cudaError_t forward(const void* x, const void* weight, const void* bias, void* y, float* mean, float* rstd,
                    int64_t rows, int64_t cols, float eps, cudaStream_t stream) {
  norm_forward_kernel<T, kRMS><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<const T*>(bias), static_cast<T*>(y),
      mean, rstd, cols, eps);
  return cudaGetLastError();
}

template <typename T, bool kRMS>
cudaError_t backward(const void* grad_y, const void* x, const void* weight, const float* mean, const float* rstd,
                     void* grad_x, float* grad_weight, float* grad_bias, float* workspace, int64_t rows,
                     int64_t cols, cudaStream_t stream) {
  norm_backward_input_kernel<T, kRMS><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(
      static_cast<const T*>(grad_y), static_cast<const T*>(x), static_cast<const T*>(weight), mean, rstd,
      static_cast<T*>(grad_x), cols);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  const int64_t chunks = norm_grad_chunks(rows);
  const unsigned column_blocks = static_cast<unsigned>((cols + kColumnThreads - 1) / kColumnThreads);
  const bool with_bias = grad_bias != nullptr;
  norm_backward_params_kernel<T, kRMS><<<dim3(column_blocks, static_cast<unsigned>(chunks)), kColumnThreads, 0,
                                         stream>>>(static_cast<const T*>(grad_y), static_cast<const T*>(x), mean,
                                                   rstd, workspace, rows, cols, with_bias);
  error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  sum_chunks_kernel<<<column_blocks, kColumnThreads, 0, stream>>>(workspace, grad_weight, chunks, cols);
  if (with_bias) {
    sum_chunks_kernel<<<column_blocks, kColumnThreads, 0, stream>>>(workspace + chunks * cols, grad_bias, chunks,
                                                                    cols);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t norm_forward(const void* x, const void* weight, const void* bias, void* y, float* mean, float* rstd,
                         int64_t rows, int64_t cols, float eps, bool rms, DType dtype, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (rows > kMaxGridX) return cudaErrorInvalidConfiguration;
  if (rms) {
    MEGALITE_DISPATCH(dtype, return (forward<T, true>(x, weight, nullptr, y, nullptr, rstd, rows, cols, eps, stream)));
  }
  MEGALITE_DISPATCH(dtype, return (forward<T, false>(x, weight, bias, y, mean, rstd, rows, cols, eps, stream)));
  return cudaSuccess;
}

cudaError_t norm_backward(const void* grad_y, const void* x, const void* weight, const float* mean, const float* rstd,
                          void* grad_x, float* grad_weight, float* grad_bias, float* workspace, int64_t rows,
                          int64_t cols, bool rms, DType dtype, cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  if (rows > kMaxGridX) return cudaErrorInvalidConfiguration;
  if (rows == 0) {   // no rows: the parameter gradients are sums over nothing
    cudaError_t error = cudaMemsetAsync(grad_weight, 0, cols * sizeof(float), stream);
    if (error == cudaSuccess && grad_bias != nullptr) {
      error = cudaMemsetAsync(grad_bias, 0, cols * sizeof(float), stream);
    }
    return error;
  }
  if (rms) {
    MEGALITE_DISPATCH(dtype, return (backward<T, true>(grad_y, x, weight, nullptr, rstd, grad_x, grad_weight, nullptr,
                                                       workspace, rows, cols, stream)));
  }
  MEGALITE_DISPATCH(dtype, return (backward<T, false>(grad_y, x, weight, mean, rstd, grad_x, grad_weight, grad_bias,
                                                      workspace, rows, cols, stream)));
  return cudaSuccess;
}

}  // namespace megalite
