"""AdamW for fp32 parameters and states that live on the CPU (``--optimizer-cpu-offload``), one fused pass per tensor.

Same maths, arguments, param groups and state keys as ``torch.optim.AdamW`` (``step`` a float tensor, ``exp_avg``,
``exp_avg_sq``), so a state dict moves between the two either way. The update runs in the C++ kernel of
``csrc/cpu_adam.cpp`` (built on first use) when it is available, else in the same sequence of torch ops that
``torch.optim.AdamW`` runs; ``use_kernel`` says which. Gradients may be fp32 or bf16 (the bf16 gradients of a
mixed-precision model copied off the GPU are used as they are, without an fp32 copy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from megalite.extensions import load_extension

_EXTENSION = ("cpu_adam", ["cpu_adam.cpp"])
_GRAD_DTYPES = (torch.float32, torch.bfloat16)


class CPUAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` for CPU fp32 parameters; ``use_kernel`` None picks the C++ kernel when it builds."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, maximize: bool = False, foreach: bool | None = None,
                 use_kernel: bool | None = None) -> None:
        if amsgrad or maximize or foreach:
            raise ValueError("CPUAdamW supports neither amsgrad, maximize nor foreach (it fuses each tensor instead)")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        kernel_available = use_kernel is not False and load_extension(*_EXTENSION) is not None
        if use_kernel and not kernel_available:
            raise RuntimeError("use_kernel=True but the cpu_adam extension could not be built (see the warning)")
        self.use_kernel: bool = kernel_available
        # The keys torch.optim.AdamW keeps in every group too: loading a group into AdamW without
        # decoupled_weight_decay would silently turn it into Adam with L2 regularization.
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
                        foreach=None, capturable=False, differentiable=False, fused=None, decoupled_weight_decay=True)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if p.device.type != "cpu" or p.dtype != torch.float32:
                raise ValueError(f"CPUAdamW needs CPU float32 parameters, got {p.dtype} on {p.device}")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        kernel = load_extension(*_EXTENSION) if self.use_kernel else None
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or not group["decoupled_weight_decay"]:
                raise ValueError("CPUAdamW: a loaded param group asks for amsgrad, maximize or coupled weight decay")
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = float(group["lr"]), group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse or grad.device.type != "cpu" or grad.dtype not in _GRAD_DTYPES:
                    raise ValueError(f"CPUAdamW needs dense CPU float32 or bfloat16 gradients, got {grad.dtype} "
                                     f"on {grad.device}{' (sparse)' if grad.is_sparse else ''}")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                if kernel is not None:
                    kernel.adamw_step(p, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], lr,
                                      float(beta1), float(beta2), eps, weight_decay, step)
                else:
                    adamw_step_torch(p, grad, state["exp_avg"], state["exp_avg_sq"], lr, float(beta1),
                                     float(beta2), eps, weight_decay, step)
        return loss


def adamw_step_torch(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float) -> None:
    """The fallback: torch.optim.AdamW's single-tensor update, op for op (``step`` counted after the increment)."""
    grad = grad.float()
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _scalar_dtype() -> torch.dtype:
    # torch.optim keeps `step` in float64 only when that is the default dtype.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
