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
from megalite.tensor_parallel import TensorParallelRNG

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
