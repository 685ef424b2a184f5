// Rotary position embedding applied to queries or keys, rotate-half convention (channel p paired with p + dim/2),
// and its transpose for the backward.
//
// One block per (batch, head, position) row, one thread per channel pair. The input may be strided (queries and keys
// are views into the fused QKV projection's output, [batch, seq, heads, dim] transposed to [batch, heads, seq, dim]),
// which saves the copy a .contiguous() would make; the output is contiguous. cos and sin stay fp32 (the model computes
// them in fp32), so the angles are not rounded to the input's dtype before they are applied.

#include "common.cuh"

namespace megalite {
namespace {

template <typename T>
__global__ void rope_kernel(const T* __restrict__ x, const float* __restrict__ cos, const float* __restrict__ sin,
                            T* __restrict__ y, int64_t heads, int64_t seq, int64_t dim, int64_t stride_b,
                            int64_t stride_h, int64_t stride_s, bool transpose) {
  const int64_t row = blockIdx.x;   // (b * heads + h) * seq + s
  const int64_t s = row % seq, h = (row / seq) % heads, b = row / (seq * heads);
  const T* x_row = x + b * stride_b + h * stride_h + s * stride_s;
  T* y_row = y + row * dim;
  const float* cos_row = cos + s * dim;
  const float* sin_row = sin + s * dim;
  const int64_t half = dim / 2;
  for (int64_t p = threadIdx.x; p < half; p += blockDim.x) {
    const float first = to_float(x_row[p]), second = to_float(x_row[p + half]);
    float out_first, out_second;
    if (!transpose) {
      out_first = first * cos_row[p] - second * sin_row[p];
      out_second = second * cos_row[p + half] + first * sin_row[p + half];
    } else {   // the transposed map: (R^T g)[p] = g[p] cos[p] + g[p + half] sin[p + half], and so on
      out_first = first * cos_row[p] + second * sin_row[p + half];
      out_second = second * cos_row[p + half] - first * sin_row[p];
    }
    y_row[p] = from_float<T>(out_first);
    y_row[p + half] = from_float<T>(out_second);
  }
}

}  // namespace

cudaError_t rope_apply(const void* x, const float* cos, const float* sin, void* y, int64_t batch, int64_t heads,
                       int64_t seq, int64_t dim, int64_t stride_b, int64_t stride_h, int64_t stride_s, bool transpose,
                       DType dtype, cudaStream_t stream) {
  const int64_t rows = batch * heads * seq;
  if (rows == 0 || dim == 0) return cudaSuccess;
  if (rows > kMaxGridX || dim % 2 != 0) return cudaErrorInvalidValue;
  int threads = kWarpSize;
  while (threads < 128 && threads < dim / 2) threads *= 2;
  MEGALITE_DISPATCH(dtype, rope_kernel<T><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
                               static_cast<const T*>(x), cos, sin, static_cast<T*>(y), heads, seq, dim, stride_b,
                               stride_h, stride_s, transpose));
  return cudaGetLastError();
}

}  // namespace megalite
