"""Activation memory of one transformer layer in one process (no recompute, selective, full), against Korthikanti et
al. 2022's per-layer formula adjusted to fp32 on the CPU (see tests/activation_memory.py). The TP and sequence-parallel
variants run in tests/multiprocess/test_activation_memory.py.

GPT-2-style layer (LayerNorm, GeLU, learned positions: the paper's model), dropout 0.1 so the masks the formula counts
exist; s=32, b=2, h=64, a=4 (as/h = 2, so the attention-score terms matter). Measured / formula is printed and must lie
within 1% (measured: exactly 1 up to the LayerNorm statistics, which the adjusted formula includes).
"""

from __future__ import annotations

import pytest
import torch

from megalite.model.transformer import TransformerLayer, run_layers
from megalite.tensor_parallel import TensorParallelRNG, initialize_parameters

from ..activation_memory import korthikanti_bytes, layer_norm_statistics_bytes, saved_bytes
from ..helpers import tiny_config

B, S = 2, 32

pytestmark = pytest.mark.usefixtures("single_process_layout")   # tests/conftest.py


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_saved_bytes_per_layer_match_korthikanti(recompute):
    model = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "recompute_granularity": recompute,
             "recompute_method": "uniform" if recompute == "full" else None, "num_layers": 1}
    cfg = tiny_config(model=model).model
    rng = TensorParallelRNG(0, 0, 0, torch.device("cpu"))
    layers = torch.nn.ModuleList([TransformerLayer(cfg, rng)])
    x = torch.randn(B, S, cfg.hidden_size, requires_grad=True)
    measured, output = saved_bytes(lambda h: run_layers(layers, h, cfg, rng), x, exclude=list(layers.parameters()))
    h, a = cfg.hidden_size, cfg.num_attention_heads
    paper = korthikanti_bytes(S, B, h, a, recompute=recompute)            # fp16, byte masks: sbh(34 + 5as/h)
    adjusted = korthikanti_bytes(S, B, h, a, recompute=recompute, p=4, m=4)
    if recompute != "full":
        adjusted += layer_norm_statistics_bytes(S, B)
    ratio = measured / adjusted
    print(f"recompute={recompute}: {measured} bytes per layer, {measured / (S * B * h):.2f} x sbh; adjusted formula "
          f"{adjusted:.0f} (ratio {ratio:.4f}); the paper's fp16 number {paper:.0f} (ratio {measured / paper:.3f})")
    assert 0.99 <= ratio <= 1.01
    output.sum().backward()   # the graph is whole: backward (with recompute, if any) runs
    assert x.grad is not None


@pytest.mark.parametrize("modules, saved_sbh", [
    (["core_attn"], 0),
    (["core_attn", "mlp"], 8),          # fc1's output and the GeLU's, 4h wide each
    (["core_attn", "layernorm"], 2),    # both norms' outputs (and their statistics: they run without grad)
    (["core_attn", "layernorm", "mlp"], 10),
])
def test_recompute_modules_save_their_activations_and_change_no_gradient(modules, saved_sbh):
    """--recompute-modules, Megatron's semantics: each module's activations leave what autograd keeps (measured
    against core_attn alone, in units of s b h fp32 elements beside the attention scores), and the gradients are
    bit for bit those without recompute (dropout on: the recomputed parts replay the same masks)."""
    def run(recompute, modules=None):
        model = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "recompute_granularity": recompute,
                 "recompute_modules": " ".join(modules) if modules else None, "num_layers": 1}
        cfg = tiny_config(model=model).model
        torch.manual_seed(0)
        rng = TensorParallelRNG(0, 0, 0, torch.device("cpu"))
        layers = torch.nn.ModuleList([TransformerLayer(cfg, rng)])
        with torch.no_grad():
            initialize_parameters(layers.named_parameters(), 0, 0, 1)
        x = torch.randn(B, S, cfg.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
        measured, output = saved_bytes(lambda h: run_layers(layers, h, cfg, rng), x, exclude=list(layers.parameters()))
        output.square().sum().backward()
        return measured, [x.grad, *(p.grad for p in layers.parameters())]

    plain_bytes, plain_grads = run(None)
    core_bytes, _ = run("selective")
    measured, grads = run("selective", modules)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    h = tiny_config().model.hidden_size
    statistics = layer_norm_statistics_bytes(S, B) if "layernorm" in modules else 0
    assert core_bytes - measured == saved_sbh * S * B * h * 4 + statistics and measured < plain_bytes
