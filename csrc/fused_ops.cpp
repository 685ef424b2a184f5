// Torch bindings of the fused CUDA kernels (csrc/cuda/): check tensors, allocate outputs, call a launcher on the
// current stream of the tensors' device. No arithmetic happens here.
//
// The functions mirror megalite/kernels/torch_ops.py name for name and argument for argument, so the autograd
// functions of megalite/kernels/fused.py run on either: inputs in fp32, bf16 or fp16 (parameters in the input's
// dtype), statistics and parameter gradients returned in fp32. Inputs that must be contiguous are made so (a no-op
// for the tensors the model passes; gradients from autograd are sometimes expanded views).
//
// set_poison_outputs(True), for tools/gpu_check.py only, fills every output and workspace with NaN before the kernel
// runs, so an element a kernel forgets to write shows up as NaN instead of as whatever the allocator left there.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/python.h>

#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "cuda/fused_kernels.h"

namespace {

using megalite::DType;
using Tensor = at::Tensor;

DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK(false, "megalite fused kernels take float32, bfloat16 or float16 tensors, got ", t.scalar_type());
  }
}

void check_cuda(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "megalite fused kernels: ", name, " must be a CUDA tensor, got one on ", t.device());
}

void check_same(const Tensor& t, const Tensor& like, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "megalite fused kernels: ", name, " is ", t.scalar_type(),
              " but the input is ", like.scalar_type());
  TORCH_CHECK(t.device() == like.device(), "megalite fused kernels: ", name, " is on ", t.device(),
              " but the input is on ", like.device());
}

void check_float(const Tensor& t, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "megalite fused kernels: ", name, " must be float32, got ",
              t.scalar_type());
}

void check_launch(cudaError_t error, const char* kernel) {
  TORCH_CHECK(error == cudaSuccess, "megalite fused kernel ", kernel, " failed to launch: ",
              cudaGetErrorString(error));
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

bool poison_outputs = false;

// A contiguous output (or workspace) for a kernel to fill.
Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  Tensor t = at::empty(sizes, options.memory_format(at::MemoryFormat::Contiguous));
  if (poison_outputs) t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

Tensor new_output_like(const Tensor& x) { return new_output(x.sizes(), x.options()); }

// [..., 1] fp32: one statistic per row of x (the shape torch_ops returns, so saved tensors look alike).
Tensor row_statistic(const Tensor& x) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = 1;
  return new_output(shape, x.options().dtype(at::kFloat));
}

// ---- scaled upper-triangular masked softmax ----

Tensor masked_softmax_forward(const Tensor& input, double scale) {
  check_cuda(input, "scores");
  TORCH_CHECK(input.dim() == 3 && input.size(1) == input.size(2),
              "masked softmax takes scores [batches, sq, sk] with sq == sk, got ", input.sizes());
  const c10::cuda::CUDAGuard guard(input.device());
  const Tensor x = input.contiguous();
  Tensor y = new_output_like(x);
  check_launch(megalite::masked_softmax_forward(x.data_ptr(), y.data_ptr(), x.size(0), x.size(1), x.size(2),
                                                static_cast<float>(scale), dtype_of(x), stream()),
               "masked_softmax_forward");
  return y;
}

Tensor masked_softmax_backward(const Tensor& grad_output, const Tensor& output, double scale) {
  check_cuda(output, "probabilities");
  check_same(grad_output, output, "grad");
  TORCH_CHECK(output.dim() == 3 && grad_output.sizes() == output.sizes(), "masked softmax backward: grad ",
              grad_output.sizes(), " and probabilities ", output.sizes(), " must be equal [batches, sq, sk]");
  const c10::cuda::CUDAGuard guard(output.device());
  const Tensor g = grad_output.contiguous(), y = output.contiguous();
  Tensor grad_x = new_output_like(y);
  check_launch(megalite::masked_softmax_backward(g.data_ptr(), y.data_ptr(), grad_x.data_ptr(), y.size(0), y.size(1),
                                                 y.size(2), static_cast<float>(scale), dtype_of(y), stream()),
               "masked_softmax_backward");
  return grad_x;
}

// ---- bias + GeLU ----

void check_bias(const Tensor& x, const Tensor& bias) {
  check_same(bias, x, "bias");
  TORCH_CHECK(x.dim() >= 1 && bias.dim() == 1 && bias.size(0) == x.size(-1), "bias ", bias.sizes(),
              " does not match the last dimension of ", x.sizes());
}

Tensor bias_gelu_forward(const Tensor& input, const Tensor& bias, bool tanh) {
  check_cuda(input, "input");
  check_bias(input, bias);
  const c10::cuda::CUDAGuard guard(input.device());
  const Tensor x = input.contiguous(), b = bias.contiguous();
  Tensor y = new_output_like(x);
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  check_launch(megalite::bias_gelu_forward(x.data_ptr(), b.data_ptr(), y.data_ptr(), rows, cols, tanh,
                                           dtype_of(x), stream()),
               "bias_gelu_forward");
  return y;
}

Tensor bias_gelu_backward(const Tensor& grad_output, const Tensor& input, const Tensor& bias, bool tanh) {
  check_cuda(input, "input");
  check_bias(input, bias);
  check_same(grad_output, input, "grad");
  TORCH_CHECK(grad_output.sizes() == input.sizes(), "bias_gelu backward: grad ", grad_output.sizes(),
              " and input ", input.sizes(), " differ");
  const c10::cuda::CUDAGuard guard(input.device());
  const Tensor g = grad_output.contiguous(), x = input.contiguous(), b = bias.contiguous();
  Tensor grad_x = new_output_like(x);
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  check_launch(megalite::bias_gelu_backward(g.data_ptr(), x.data_ptr(), b.data_ptr(), grad_x.data_ptr(), rows, cols,
                                            tanh, dtype_of(x), stream()),
               "bias_gelu_backward");
  return grad_x;
}

// ---- LayerNorm and RMSNorm ----

void check_norm_parameter(const Tensor& x, const Tensor& parameter, const char* name) {
  check_same(parameter, x, name);
  TORCH_CHECK(x.dim() >= 1 && parameter.dim() == 1 && parameter.size(0) == x.size(-1), name, " ", parameter.sizes(),
              " does not match the normalized dimension of ", x.sizes());
}

std::tuple<Tensor, Tensor, Tensor> norm_forward(const Tensor& input, const Tensor& weight,
                                                const std::optional<Tensor>& bias, double eps, bool rms) {
  check_cuda(input, "input");
  check_norm_parameter(input, weight, "weight");
  if (bias) check_norm_parameter(input, *bias, "bias");
  const c10::cuda::CUDAGuard guard(input.device());
  const Tensor x = input.contiguous(), w = weight.contiguous();
  const Tensor b = bias ? bias->contiguous() : Tensor();
  Tensor y = new_output_like(x);
  Tensor mean = rms ? Tensor() : row_statistic(x);
  Tensor rstd = row_statistic(x);
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  check_launch(megalite::norm_forward(x.data_ptr(), w.data_ptr(), b.defined() ? b.data_ptr() : nullptr,
                                      y.data_ptr(), rms ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                      rows, cols, static_cast<float>(eps), rms, dtype_of(x), stream()),
               "norm_forward");
  return {y, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> norm_backward(const Tensor& grad_output, const Tensor& input, const Tensor& weight,
                                                 const std::optional<Tensor>& mean, const Tensor& rstd,
                                                 bool with_bias) {
  check_cuda(input, "input");
  check_norm_parameter(input, weight, "weight");
  check_same(grad_output, input, "grad");
  TORCH_CHECK(grad_output.sizes() == input.sizes(), "norm backward: grad ", grad_output.sizes(), " and input ",
              input.sizes(), " differ");
  const int64_t cols = input.size(-1), rows = cols == 0 ? 0 : input.numel() / cols;
  check_float(rstd, "rstd");
  TORCH_CHECK(rstd.numel() == rows, "rstd has ", rstd.numel(), " elements for ", rows, " rows");
  if (mean) {
    check_float(*mean, "mean");
    TORCH_CHECK(mean->numel() == rows, "mean has ", mean->numel(), " elements for ", rows, " rows");
  }
  const c10::cuda::CUDAGuard guard(input.device());
  const Tensor g = grad_output.contiguous(), x = input.contiguous(), w = weight.contiguous();
  const Tensor m = mean ? mean->contiguous() : Tensor(), r = rstd.contiguous();
  Tensor grad_x = new_output_like(x);
  const auto fp32 = x.options().dtype(at::kFloat);
  Tensor grad_weight = new_output({cols}, fp32);
  Tensor grad_bias = with_bias ? new_output({cols}, fp32) : Tensor();
  Tensor workspace = new_output({(with_bias ? 2 : 1) * megalite::norm_grad_chunks(rows), cols}, fp32);
  check_launch(megalite::norm_backward(g.data_ptr(), x.data_ptr(), w.data_ptr(),
                                       m.defined() ? m.data_ptr<float>() : nullptr, r.data_ptr<float>(),
                                       grad_x.data_ptr(), grad_weight.data_ptr<float>(),
                                       with_bias ? grad_bias.data_ptr<float>() : nullptr,
                                       workspace.data_ptr<float>(), rows, cols, !mean.has_value(), dtype_of(x),
                                       stream()),
               "norm_backward");
  return {grad_x, grad_weight, grad_bias};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_forward(const Tensor& x, const Tensor& weight,
                                                      const std::optional<Tensor>& bias, double eps) {
  return norm_forward(x, weight, bias, eps, /*rms=*/false);
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(const Tensor& grad_output, const Tensor& x,
                                                       const Tensor& weight, const Tensor& mean, const Tensor& rstd) {
  return norm_backward(grad_output, x, weight, mean, rstd, /*with_bias=*/true);
}

std::tuple<Tensor, Tensor> rms_norm_forward(const Tensor& x, const Tensor& weight, double eps) {
  auto [y, mean, rstd] = norm_forward(x, weight, std::nullopt, eps, /*rms=*/true);
  return {y, rstd};
}

std::tuple<Tensor, Tensor> rms_norm_backward(const Tensor& grad_output, const Tensor& x, const Tensor& weight,
                                             const Tensor& rstd) {
  auto [grad_x, grad_weight, grad_bias] = norm_backward(grad_output, x, weight, std::nullopt, rstd, false);
  return {grad_x, grad_weight};
}

// ---- rotary embedding ----

Tensor rope(const Tensor& input, const Tensor& cos, const Tensor& sin, bool transpose) {
  check_cuda(input, "input");
  check_float(cos, "cos");
  check_float(sin, "sin");
  TORCH_CHECK(input.dim() == 4 && input.size(-1) % 2 == 0,
              "rotary embedding takes [batch, heads, seq, dim] with an even dim, got ", input.sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == input.size(2) && cos.size(1) == input.size(3) &&
                  sin.sizes() == cos.sizes(),
              "cos ", cos.sizes(), " and sin ", sin.sizes(), " must be [seq, dim] of ", input.sizes());
  TORCH_CHECK(cos.device() == input.device() && sin.device() == input.device(), "cos and sin must be on ",
              input.device());
  const c10::cuda::CUDAGuard guard(input.device());
  const Tensor x = input.stride(-1) == 1 ? input : input.contiguous();   // other strides are handled by the kernel
  const Tensor c = cos.contiguous(), s = sin.contiguous();
  Tensor y = new_output(x.sizes(), x.options());
  check_launch(megalite::rope_apply(x.data_ptr(), c.data_ptr<float>(), s.data_ptr<float>(), y.data_ptr(), x.size(0),
                                    x.size(1), x.size(2), x.size(3), x.stride(0), x.stride(1), x.stride(2), transpose,
                                    dtype_of(x), stream()),
               "rope_apply");
  return y;
}

Tensor rope_forward(const Tensor& x, const Tensor& cos, const Tensor& sin) { return rope(x, cos, sin, false); }

Tensor rope_backward(const Tensor& grad_output, const Tensor& cos, const Tensor& sin) {
  return rope(grad_output, cos, sin, true);
}

// ---- vocabulary-parallel cross entropy, per shard ----

void check_target(const Tensor& logits, const Tensor& target) {
  check_cuda(target, "target");
  TORCH_CHECK(target.scalar_type() == at::kLong, "target must be int64, got ", target.scalar_type());
  TORCH_CHECK(logits.dim() >= 1 && target.numel() * logits.size(-1) == logits.numel(), "target ", target.sizes(),
              " does not match logits ", logits.sizes());
}

std::tuple<Tensor, Tensor, Tensor> cross_entropy_stats(const Tensor& logits, const Tensor& target,
                                                       int64_t valid_cols) {
  check_cuda(logits, "logits");
  check_target(logits, target);
  TORCH_CHECK(0 <= valid_cols && valid_cols <= logits.size(-1), "valid columns ", valid_cols, " not in [0, ",
              logits.size(-1), "]");
  const c10::cuda::CUDAGuard guard(logits.device());
  const Tensor x = logits.contiguous(), t = target.contiguous();
  const auto fp32 = x.options().dtype(at::kFloat);
  Tensor max = new_output(target.sizes(), fp32), sum = new_output(target.sizes(), fp32);
  Tensor target_logit = new_output(target.sizes(), fp32);
  check_launch(megalite::cross_entropy_stats(x.data_ptr(), t.data_ptr<int64_t>(), max.data_ptr<float>(),
                                             sum.data_ptr<float>(), target_logit.data_ptr<float>(), t.numel(),
                                             x.size(-1), valid_cols, dtype_of(x), stream()),
               "cross_entropy_stats");
  return {max, sum, target_logit};
}

Tensor cross_entropy_grad(const Tensor& logits, const Tensor& target, const Tensor& max, const Tensor& sum_exp,
                          const Tensor& grad_loss, int64_t valid_cols) {
  check_cuda(logits, "logits");
  check_target(logits, target);
  const auto check_row_values = [&](const Tensor& t, const char* name) {
    check_float(t, name);
    TORCH_CHECK(t.numel() == target.numel(), name, " has ", t.numel(), " elements for ", target.numel(), " rows");
  };
  check_row_values(max, "max");
  check_row_values(sum_exp, "sum_exp");
  check_row_values(grad_loss, "grad_loss");
  TORCH_CHECK(0 <= valid_cols && valid_cols <= logits.size(-1), "valid columns ", valid_cols, " not in [0, ",
              logits.size(-1), "]");
  const c10::cuda::CUDAGuard guard(logits.device());
  const Tensor x = logits.contiguous(), t = target.contiguous();
  const Tensor m = max.contiguous(), s = sum_exp.contiguous(), g = grad_loss.contiguous();
  Tensor grad = new_output_like(x);
  check_launch(megalite::cross_entropy_grad(x.data_ptr(), t.data_ptr<int64_t>(), m.data_ptr<float>(),
                                            s.data_ptr<float>(), g.data_ptr<float>(), grad.data_ptr(), t.numel(),
                                            x.size(-1), valid_cols, dtype_of(x), stream()),
               "cross_entropy_grad");
  return grad;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megalite's fused CUDA kernels (see csrc/cuda/fused_kernels.h); torch ops in megalite/kernels/torch_ops.py";
  m.def("masked_softmax_forward", &masked_softmax_forward, "causal softmax(scale * x)", py::arg("x"), py::arg("scale"));
  m.def("masked_softmax_backward", &masked_softmax_backward, py::arg("grad_y"), py::arg("y"), py::arg("scale"));
  m.def("bias_gelu_forward", &bias_gelu_forward, "gelu(x + bias), exact or tanh", py::arg("x"), py::arg("bias"),
        py::arg("tanh") = false);
  m.def("bias_gelu_backward", &bias_gelu_backward, py::arg("grad_y"), py::arg("x"), py::arg("bias"),
        py::arg("tanh") = false);
  m.def("layer_norm_forward", &layer_norm_forward, "(y, mean, rstd)", py::arg("x"), py::arg("weight"),
        py::arg("bias"), py::arg("eps"));
  m.def("layer_norm_backward", &layer_norm_backward, "(grad_x, grad_weight, grad_bias)", py::arg("grad_y"),
        py::arg("x"), py::arg("weight"), py::arg("mean"), py::arg("rstd"));
  m.def("rms_norm_forward", &rms_norm_forward, "(y, rstd)", py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("rms_norm_backward", &rms_norm_backward, "(grad_x, grad_weight)", py::arg("grad_y"), py::arg("x"),
        py::arg("weight"), py::arg("rstd"));
  m.def("rope_forward", &rope_forward, py::arg("x"), py::arg("cos"), py::arg("sin"));
  m.def("rope_backward", &rope_backward, py::arg("grad_y"), py::arg("cos"), py::arg("sin"));
  m.def("cross_entropy_stats", &cross_entropy_stats, "(max, sum_exp, target_logit)", py::arg("logits"),
        py::arg("target"), py::arg("valid_cols"));
  m.def("set_poison_outputs", [](bool on) { poison_outputs = on; }, "fill outputs with NaN before kernels write them",
        py::arg("on"));
  m.def("cross_entropy_grad", &cross_entropy_grad, py::arg("logits"), py::arg("target"), py::arg("max"),
        py::arg("sum_exp"), py::arg("grad_loss"), py::arg("valid_cols"));
}
