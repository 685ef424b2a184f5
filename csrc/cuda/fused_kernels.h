// Launchers of megalite's fused CUDA kernels: plain C++ declarations on raw pointers and a stream.
//
// The kernels (csrc/cuda/*.cu) include no torch header, so CI can compile each of them with `nvcc -c` on a machine
// without a GPU or a CUDA build of torch; csrc/fused_ops.cpp checks tensors, allocates outputs and calls these with
// torch's current stream. Every kernel reads fp32, bf16 or fp16 and accumulates in fp32; statistics (means, rstd,
// softmax maxima and sums) are fp32 whatever the input. Tensors are contiguous unless a stride is passed. Each
// launcher returns the launch's cudaError_t (cudaSuccess, or e.g. cudaErrorInvalidConfiguration) without
// synchronizing; an empty problem launches nothing.

#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megalite {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Causal softmax of scale * x over the last dimension: x and y are [batches, sq, sk] with sq == sk, and row i of a
// batch sees keys 0..i (the rest of the row is written as exactly 0), Megatron's scaled upper-triangular masked
// softmax. Backward: grad_x = scale * y * (grad_y - sum(grad_y * y)), from the forward's output y.
cudaError_t masked_softmax_forward(const void* x, void* y, int64_t batches, int64_t sq, int64_t sk, float scale,
                                   DType dtype, cudaStream_t stream);
cudaError_t masked_softmax_backward(const void* grad_y, const void* y, void* grad_x, int64_t batches, int64_t sq,
                                    int64_t sk, float scale, DType dtype, cudaStream_t stream);

// y = gelu(x + bias) with the exact (erf) GeLU, or its tanh approximation when tanh is true, bias broadcast over
// rows: x and y are [rows, cols], bias [cols]. Backward: grad_x = grad_y * gelu'(x + bias), which is also the gradient
// of the pre-activation (the caller sums it over rows for the bias).
cudaError_t bias_gelu_forward(const void* x, const void* bias, void* y, int64_t rows, int64_t cols, bool tanh,
                              DType dtype, cudaStream_t stream);
cudaError_t bias_gelu_backward(const void* grad_y, const void* x, const void* bias, void* grad_x, int64_t rows,
                               int64_t cols, bool tanh, DType dtype, cudaStream_t stream);

// LayerNorm (rms == false) or RMSNorm (rms == true) over the last dimension of x [rows, cols]; weight (and bias,
// LayerNorm only; may be null) [cols] have x's dtype. Forward writes y and the per-row fp32 statistics: mean (null
// for RMSNorm) and rstd = 1 / sqrt(var + eps) (RMSNorm: 1 / sqrt(mean(x^2) + eps)).
cudaError_t norm_forward(const void* x, const void* weight, const void* bias, void* y, float* mean, float* rstd,
                         int64_t rows, int64_t cols, float eps, bool rms, DType dtype, cudaStream_t stream);
// Backward: grad_x in x's dtype; grad_weight (and grad_bias when non-null) in fp32, [cols]. workspace holds
// norm_grad_chunks(rows) x cols fp32 partial sums per parameter gradient (so 2x that with a bias).
cudaError_t norm_backward(const void* grad_y, const void* x, const void* weight, const float* mean, const float* rstd,
                          void* grad_x, float* grad_weight, float* grad_bias, float* workspace, int64_t rows,
                          int64_t cols, bool rms, DType dtype, cudaStream_t stream);

// Row chunks of norm_backward's parameter-gradient reduction: each chunk sums its rows into one fp32 partial.
inline int64_t norm_grad_chunks(int64_t rows) {
  const int64_t chunks = (rows + 31) / 32;
  return chunks < 1 ? 1 : (chunks > 256 ? 256 : chunks);
}

// Rotary embedding, rotate-half convention: channel p of a head is paired with p + dim/2,
//   y[p] = x[p] cos[p] - x[p + dim/2] sin[p],  y[p + dim/2] = x[p + dim/2] cos[p + dim/2] + x[p] sin[p + dim/2],
// for x [batch, heads, seq, dim] with element strides (stride_b, stride_h, stride_s, 1) and cos, sin [seq, dim] fp32;
// y is written contiguous. transpose == true applies the transposed map (the backward: grad_x from grad_y).
cudaError_t rope_apply(const void* x, const float* cos, const float* sin, void* y, int64_t batch, int64_t heads,
                       int64_t seq, int64_t dim, int64_t stride_b, int64_t stride_h, int64_t stride_s, bool transpose,
                       DType dtype, cudaStream_t stream);

// Per-shard statistics of vocabulary-parallel cross entropy, one pass over logits [rows, cols] (this rank's slice
// of the vocabulary; columns >= valid_cols are padding and count as -inf): the row's max, the sum of exp(logit -
// max), and the target's logit (0 when target[row] is outside [0, cols), i.e. on another rank's slice), all fp32.
// A row with no valid column gets max -inf and sum 0.
cudaError_t cross_entropy_stats(const void* logits, const int64_t* target, float* max, float* sum_exp,
                                float* target_logit, int64_t rows, int64_t cols, int64_t valid_cols, DType dtype,
                                cudaStream_t stream);
// Its gradient from the global max and sum (over all shards): grad = (exp(logit - max) / sum - onehot(target)) *
// grad_loss, 0 on padding columns, in the logits' dtype.
cudaError_t cross_entropy_grad(const void* logits, const int64_t* target, const float* max, const float* sum_exp,
                               const float* grad_loss, void* grad_logits, int64_t rows, int64_t cols,
                               int64_t valid_cols, DType dtype, cudaStream_t stream);

}  // namespace megalite
