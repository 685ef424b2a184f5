"""The transformer MLP: h -> ffn column-parallel, activation on this rank's slice, ffn -> h row-parallel.

The activation is GeLU (exact, or with ``--openai-gelu`` its tanh approximation, as OpenAI's GPT-2), or a gated
linear unit (Shazeer 2020): SwiGLU silu(x W_gate) * (x W_up), GeGLU (``--gated-linear-unit``) with gelu (exact or
tanh as above; Gemma's is tanh), or quick GeGLU (``--quick-geglu``) with quick_gelu(y) = y sigmoid(1.702 y). A gated
unit's first weight is the stack [W_gate; W_up] (Hugging Face's gate_proj above up_proj), each block split over TP
separately so a rank holds the gate and up rows of the same ffn channels and the product needs no communication.
Megatron's two knobs of the gated unit (gpt-oss' experts use both): ``--activation-func-clamp-value c`` clamps the
gate to at most c and the up half to [-c, c] first, and ``--glu-linear-offset o`` adds o to the up half:
act(min(gate, c)) * (clamp(up, -c, c) + o).

With GeLU and biases, on CUDA tensors the first linear skips its bias add and a fused kernel computes gelu(y + bias)
when the kernel policy says so (``--no-bias-gelu-fusion`` turns it off): one pass over the ffn activations, not two;
the kernel computes the same GeLU (exact or tanh) as the torch path.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.kernels import DEFAULT_POLICY, KernelPolicy, fused
from megalite.kernels.policy import BIAS_GELU
from megalite.tensor_parallel import ColumnParallelLinear, Fp8Recipe, RowParallelLinear


def quick_gelu(y: torch.Tensor) -> torch.Tensor:
    """GeLU's sigmoid approximation y sigmoid(1.702 y) (Hendrycks and Gimpel 2016; Megatron's quick_gelu)."""
    return y * torch.sigmoid(1.702 * y)


def gated_activation(cfg: ModelConfig):
    """The gated unit of ``cfg`` on the first linear's output [..., 2f] = [gate | up] (see the module docstring); the
    same function for the dense MLP and the experts."""
    if cfg.swiglu:
        act = F.silu
    elif cfg.quick_geglu:
        act = quick_gelu
    else:   # --gated-linear-unit: GeGLU, exact or (--openai-gelu) tanh
        act = functools.partial(F.gelu, approximate="tanh" if cfg.openai_gelu else "none")
    clamp, offset = cfg.activation_func_clamp_value, cfg.glu_linear_offset

    def glu(y: torch.Tensor) -> torch.Tensor:
        gate, up = y.chunk(2, dim=-1)
        if clamp is not None:
            gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
        return act(gate) * (up + offset if offset else up)
    return glu


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, sequence_parallel: bool = False, kernels: KernelPolicy = DEFAULT_POLICY):
        super().__init__()
        self.kernels = kernels
        output_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        bias = not cfg.disable_bias_linear
        self.glu = gated_activation(cfg) if cfg.gated_mlp else None
        self.gelu_approximation = "tanh" if cfg.openai_gelu else "none"   # F.gelu's names
        fc1_size = 2 * cfg.ffn_size if cfg.gated_mlp else cfg.ffn_size
        fp8 = Fp8Recipe.of(cfg)   # --fp8-format: both linears' products in FP8
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden_size, fc1_size, fused=2 if cfg.gated_mlp else 1,
                                               bias=bias, init_std=cfg.init_method_std,
                                               sequence_parallel=sequence_parallel, fp8=fp8)
        self.linear_fc2 = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, bias=bias, init_std=output_std,
                                            sequence_parallel=sequence_parallel, fp8=fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.linear_fc1.bias
        ops = None if self.glu is not None or bias is None else self.kernels.ops(BIAS_GELU, x)
        if ops is not None:
            return self.linear_fc2(fused.bias_gelu(self.linear_fc1(x, skip_bias_add=True), bias, ops,
                                                   tanh=self.gelu_approximation == "tanh"))
        y = self.linear_fc1(x)
        if self.glu is not None:
            return self.linear_fc2(self.glu(y))
        return self.linear_fc2(F.gelu(y, approximate=self.gelu_approximation))
