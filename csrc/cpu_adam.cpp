// One fused AdamW step over fp32 tensors that live on the CPU (--optimizer-cpu-offload).
//
// torch.optim.AdamW makes about eight passes over memory per parameter (mul_, lerp_, mul_, addcmul_, sqrt, div, add_,
// addcdiv_), each reading and writing whole tensors. Here every element is loaded once, updated in registers and
// stored once: 16 bytes read and 12 written per element (fp32 grad), which is what bounds the step on a CPU.
//
// The arithmetic is torch's, operation by operation and in the same order, with the scalars rounded to float where
// torch rounds them. It is not bitwise torch's, and cannot portably be: torch's AVX2/AVX-512 lerp_ and addcmul_
// round a multiply-add once (FMA) where this rounds twice, and torch.sqrt on a large fp32 CPU tensor is not correctly
// rounded (about 0.6% of elements are 1 ulp off; MKL's vector sqrt, it seems), where std::sqrt is. So exp_avg,
// exp_avg_sq and the parameters differ from torch's in the last bit or so for some elements.
//
// Vectorization: the loop is branch-free and written over __restrict__ pointers so that -O3 auto-vectorizes it
// (sqrtps/divps). No -march flag, so a build in a shared cache runs on any machine of the same architecture; on x86-64
// gcc's target_clones compiles it for AVX-512, AVX2 and the SSE2 baseline and picks one at load time from cpuid
// (measured 10-15% faster than SSE2 alone on one thread, equal on two, where memory bandwidth is the limit). With
// -ffp-contract=off every clone rounds identically. Threads: at::parallel_for, torch's own OpenMP pool and count.

#include <torch/extension.h>

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

namespace {

// Below this many elements a tensor is updated by the calling thread alone: waking the pool costs more than the
// ~10 us the update takes. 32768 floats = 128 KiB per tensor, so each thread's share of a big tensor is much larger.
constexpr int64_t kGrainSize = 1 << 15;

// The per-step scalars, rounded to float exactly where torch rounds them (a Python float applied to a float tensor).
struct Scalars {
  float decay;          // 1 - lr * weight_decay, 1 when there is no decay (x * 1.0f == x, so no branch is needed)
  float avg_weight;     // lerp weight 1 - beta1
  bool small_weight;    // torch's lerp takes one of two formulas depending on |weight| < 0.5
  float beta2;
  float sq_weight;      // 1 - beta2
  float bc2_sqrt;       // sqrt(1 - beta2^step), as Python's (1 - beta2**step) ** 0.5
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
};

template <typename grad_t>
inline __attribute__((always_inline)) void update_range(float* __restrict__ param, const grad_t* __restrict__ grad,
                                                        float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                                                        int64_t n, const Scalars s) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = static_cast<float>(grad[i]);
    // param.mul_(1 - lr * weight_decay): decoupled decay, applied before the update as torch does.
    const float p = param[i] * s.decay;
    // exp_avg.lerp_(grad, 1 - beta1), both branches of torch's lerp; the select is hoisted or blended by the compiler.
    const float m0 = exp_avg[i];
    const float m = s.small_weight ? m0 + s.avg_weight * (g - m0) : g - (g - m0) * (1.0f - s.avg_weight);
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2): addcmul computes self + value * t1 * t2.
    const float v = exp_avg_sq[i] * s.beta2 + s.sq_weight * g * g;
    // (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps): a true division, as torch's div is.
    const float denom = std::sqrt(v) / s.bc2_sqrt + s.eps;
    // param.addcdiv_(exp_avg, denom, value=-step_size): addcdiv computes self + value * t1 / t2.
    param[i] = p + s.neg_step_size * m / denom;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

// The entry points the clones are made of; update_range is inlined into each so that each is vectorized for its ISA.
#if defined(__x86_64__)
#define MEGALITE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MEGALITE_CLONES
#endif

MEGALITE_CLONES void update_f32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                                const Scalars s) {
  update_range(param, grad, exp_avg, exp_avg_sq, n, s);
}

MEGALITE_CLONES void update_bf16(float* param, const c10::BFloat16* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                                 const Scalars s) {
  update_range(param, grad, exp_avg, exp_avg_sq, n, s);
}

void check_state_tensor(const at::Tensor& t, const at::Tensor& param, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "adamw_step: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "adamw_step: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == param.numel(), "adamw_step: ", name, " has ", t.numel(), " elements, param has ",
              param.numel());
}

}  // namespace

// In place on param, exp_avg and exp_avg_sq. `step` is the step count after this step's increment (1 on the first),
// a float as torch.optim.AdamW keeps it.
void adamw_step(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq, double lr,
                double beta1, double beta2, double eps, double weight_decay, double step) {
  TORCH_CHECK(param.scalar_type() == at::kFloat, "adamw_step: param must be float32, got ", param.scalar_type());
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat, "adamw_step: exp_avg must be float32, got ",
              exp_avg.scalar_type());
  TORCH_CHECK(exp_avg_sq.scalar_type() == at::kFloat, "adamw_step: exp_avg_sq must be float32, got ",
              exp_avg_sq.scalar_type());
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16,
              "adamw_step: grad must be float32 or bfloat16, got ", grad.scalar_type());
  check_state_tensor(param, param, "param");
  check_state_tensor(grad, param, "grad");
  check_state_tensor(exp_avg, param, "exp_avg");
  check_state_tensor(exp_avg_sq, param, "exp_avg_sq");
  // The loop reads every operand through __restrict__ pointers, so no two of them may share memory.
  at::assert_no_overlap(param, grad);
  at::assert_no_overlap(param, exp_avg);
  at::assert_no_overlap(param, exp_avg_sq);
  at::assert_no_overlap(grad, exp_avg);
  at::assert_no_overlap(grad, exp_avg_sq);
  at::assert_no_overlap(exp_avg, exp_avg_sq);
  TORCH_CHECK(step >= 1, "adamw_step: step must be >= 1 (counted after the increment), got ", step);

  // Computed in double as Python computes them in torch.optim.AdamW, then rounded once to float. pow(x, 0.5) rather
  // than sqrt because that is what Python's `** 0.5` calls.
  const double bias_correction1 = 1.0 - std::pow(beta1, step);
  const double bias_correction2 = 1.0 - std::pow(beta2, step);
  const double avg_weight = 1.0 - beta1;
  Scalars s;
  s.decay = weight_decay != 0.0 ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  s.avg_weight = static_cast<float>(avg_weight);
  s.small_weight = std::abs(s.avg_weight) < 0.5f;
  s.beta2 = static_cast<float>(beta2);
  s.sq_weight = static_cast<float>(1.0 - beta2);
  s.bc2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / bias_correction1));

  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const int64_t n = param.numel();
  if (grad.scalar_type() == at::kFloat) {
    const float* g = grad.const_data_ptr<float>();
    at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) {
      update_f32(p + begin, g + begin, m + begin, v + begin, end - begin, s);
    });
  } else {
    const c10::BFloat16* g = grad.const_data_ptr<c10::BFloat16>();
    at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) {
      update_bf16(p + begin, g + begin, m + begin, v + begin, end - begin, s);
    });
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused AdamW step for fp32 parameters and states on the CPU (torch.optim.AdamW semantics).";
  // The GIL is released: the step touches no Python objects, and a training loop may overlap it with other threads.
  m.def("adamw_step", &adamw_step, "In-place AdamW step on contiguous CPU tensors (grad float32 or bfloat16)",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        py::call_guard<py::gil_scoped_release>());
}
