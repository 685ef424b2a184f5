// The per-shard part of vocabulary-parallel cross entropy: max, sum of exponentials and target logit in one pass over
// this rank's logits, and the gradient recomputed from the logits in backward.
//
// Forward keeps a running (max, sum) per thread, rescaling the sum when the max grows (the online softmax of Milakov
// & Gimelshein 2018), then merges the threads' pairs through the block: the logits are read once, instead of once
// for the max and again for the sum. The caller all-reduces the three numbers per token over TP (the max first, then
// the rescaled sums and the target logits) and saves the logits, not an fp32 softmax, for backward, which recomputes
// exp(logit - max) / sum: with bf16 logits that keeps half the bytes of an fp32 softmax, and forward writes none.

#include "common.cuh"

namespace megalite {
namespace {

template <typename T>
__global__ void cross_entropy_stats_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
                                           float* __restrict__ max_out, float* __restrict__ sum_out,
                                           float* __restrict__ target_out, int64_t cols, int64_t valid_cols) {
  __shared__ float scratch[kWarpSize];
  const int64_t row = blockIdx.x;
  const T* row_logits = logits + row * cols;

  float thread_max = -INFINITY, thread_sum = 0.0f;
  for (int64_t j = threadIdx.x; j < valid_cols; j += blockDim.x) {
    const float value = to_float(row_logits[j]);
    if (value > thread_max) {   // the first value always lands here: exp(-inf) scales the empty sum to 0
      thread_sum = thread_sum * expf(thread_max - value) + 1.0f;
      thread_max = value;
    } else if (value != -INFINITY) {   // a -inf logit adds nothing (and must not make exp(-inf - -inf) = NaN)
      thread_sum += expf(value - thread_max);
    }
  }
  const float row_max = block_max(thread_max, scratch);
  // A thread that saw nothing (max -inf) adds 0; so does every thread of a row that has no valid column.
  const float rescaled = thread_max == -INFINITY ? 0.0f : thread_sum * expf(thread_max - row_max);
  const float row_sum = block_sum(rescaled, scratch);

  if (threadIdx.x == 0) {
    const int64_t t = target[row];
    max_out[row] = row_max;
    sum_out[row] = row_sum;
    target_out[row] = (t >= 0 && t < cols) ? to_float(row_logits[t]) : 0.0f;
  }
}

template <typename T>
__global__ void cross_entropy_grad_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
                                          const float* __restrict__ max_in, const float* __restrict__ sum_in,
                                          const float* __restrict__ grad_loss, T* __restrict__ grad_logits,
                                          int64_t cols, int64_t valid_cols) {
  const int64_t row = blockIdx.x;
  const int64_t offset = row * cols;
  const int64_t t = target[row];
  const float row_max = max_in[row], row_sum = sum_in[row], scale = grad_loss[row];
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    float p = j < valid_cols ? expf(to_float(logits[offset + j]) - row_max) / row_sum : 0.0f;
    if (j == t) p -= 1.0f;
    grad_logits[offset + j] = from_float<T>(p * scale);
  }
}

}  // namespace

cudaError_t cross_entropy_stats(const void* logits, const int64_t* target, float* max, float* sum_exp,
                                float* target_logit, int64_t rows, int64_t cols, int64_t valid_cols, DType dtype,
                                cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows > kMaxGridX || valid_cols < 0 || valid_cols > cols) return cudaErrorInvalidValue;
  MEGALITE_DISPATCH(dtype, cross_entropy_stats_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0,
                                                           stream>>>(static_cast<const T*>(logits), target, max,
                                                                     sum_exp, target_logit, cols, valid_cols));
  return cudaGetLastError();
}

cudaError_t cross_entropy_grad(const void* logits, const int64_t* target, const float* max, const float* sum_exp,
                               const float* grad_loss, void* grad_logits, int64_t rows, int64_t cols,
                               int64_t valid_cols, DType dtype, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (rows > kMaxGridX || valid_cols < 0 || valid_cols > cols) return cudaErrorInvalidValue;
  MEGALITE_DISPATCH(dtype, cross_entropy_grad_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0,
                                                          stream>>>(static_cast<const T*>(logits), target, max,
                                                                    sum_exp, grad_loss, static_cast<T*>(grad_logits),
                                                                    cols, valid_cols));
  return cudaGetLastError();
}

}  // namespace megalite
