"""The transformer MLP: h -> ffn column-parallel, activation on this rank's slice, ffn -> h row-parallel.

The activation is GeLU (exact, or with ``--openai-gelu`` its tanh approximation, as OpenAI's GPT-2), or a gated
linear unit (Shazeer 2020): SwiGLU silu(x W_gate) * (x W_up), or GeGLU (``--gated-linear-unit``) gelu(x W_gate) *
(x W_up), the GeLU exact or tanh as above (Gemma's is tanh). A gated MLP's first weight is the stack
[W_gate; W_up] (Hugging Face's gate_proj above up_proj), each block split over TP separately so a rank holds the
gate and up rows of the same ffn channels and the product needs no communication.

With GeLU and biases, on CUDA tensors the first linear skips its bias add and a fused kernel computes gelu(y + bias)
when the kernel policy says so (``--no-bias-gelu-fusion`` turns it off): one pass over the ffn activations, not two;
the kernel computes the same GeLU (exact or tanh) as the torch path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.kernels import DEFAULT_POLICY, KernelPolicy, fused
from megalite.kernels.policy import BIAS_GELU
from megalite.tensor_parallel import ColumnParallelLinear, Fp8Recipe, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, sequence_parallel: bool = False, kernels: KernelPolicy = DEFAULT_POLICY):
        super().__init__()
        self.kernels = kernels
        output_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        bias = not cfg.disable_bias_linear
        self.swiglu, self.gated = cfg.swiglu, cfg.gated_mlp
        self.gelu_approximation = "tanh" if cfg.openai_gelu else "none"   # F.gelu's names
        fc1_size = 2 * cfg.ffn_size if self.gated else cfg.ffn_size
        fp8 = Fp8Recipe.of(cfg)   # --fp8-format: both linears' products in FP8
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden_size, fc1_size, fused=2 if self.gated else 1, bias=bias,
                                               init_std=cfg.init_method_std, sequence_parallel=sequence_parallel,
                                               fp8=fp8)
        self.linear_fc2 = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, bias=bias, init_std=output_std,
                                            sequence_parallel=sequence_parallel, fp8=fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.linear_fc1.bias
        ops = None if self.gated or bias is None else self.kernels.ops(BIAS_GELU, x)
        if ops is not None:
            return self.linear_fc2(fused.bias_gelu(self.linear_fc1(x, skip_bias_add=True), bias, ops,
                                                   tanh=self.gelu_approximation == "tanh"))
        y = self.linear_fc1(x)
        if self.gated:
            gate, up = y.chunk(2, dim=-1)
            activation = F.silu(gate) if self.swiglu else F.gelu(gate, approximate=self.gelu_approximation)
            return self.linear_fc2(activation * up)
        return self.linear_fc2(F.gelu(y, approximate=self.gelu_approximation))
