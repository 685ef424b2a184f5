"""Activation memory of one transformer layer at TP=2: tensor parallel alone, with sequence parallelism, and with
sequence parallelism plus selective or full recompute, against Korthikanti et al. 2022 adjusted to fp32 on the CPU
(see tests/activation_memory.py; the single-process variants are in tests/model/test_activation_memory.py).

Same layer and sizes as the single-process test: GPT-2-style, dropout 0.1, s=32, b=2, h=64, a=4. Each rank measures
its own layer (TP=2 x DP=2 over the 4 ranks); measured / formula is printed and must lie within 1%.
"""

from __future__ import annotations

import pytest
import torch

from megalite import parallel_state
from megalite.model.transformer import TransformerLayer, run_layers
from megalite.tensor_parallel import TensorParallelRNG

from ..activation_memory import korthikanti_bytes, layer_norm_statistics_bytes, saved_bytes
from ..helpers import tiny_config
from .groups import layout

B, S, TP = 2, 32, 2


@pytest.mark.parametrize("sequence_parallel, recompute", [(False, None), (True, None), (True, "selective"),
                                                          (True, "full")])
def test_saved_bytes_per_layer_match_korthikanti(sequence_parallel, recompute):
    model = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "recompute_granularity": recompute,
             "recompute_method": "uniform" if recompute == "full" else None, "num_layers": 1}
    cfg = tiny_config(tp=TP, model=model).model
    h, a = cfg.hidden_size, cfg.num_attention_heads
    with layout(TP):
        rng = TensorParallelRNG(0, parallel_state.get_tensor_model_parallel_rank(), 0, torch.device("cpu"))
        layers = torch.nn.ModuleList([TransformerLayer(cfg, rng, sequence_parallel)])
        x = torch.randn(B, S // TP if sequence_parallel else S, h, requires_grad=True)
        measured, output = saved_bytes(lambda hidden: run_layers(layers, hidden, cfg, rng), x,
                                       exclude=list(layers.parameters()))
        paper = korthikanti_bytes(S, B, h, a, TP, sequence_parallel=sequence_parallel, recompute=recompute)
        adjusted = korthikanti_bytes(S, B, h, a, TP, sequence_parallel=sequence_parallel, recompute=recompute,
                                     p=4, m=4)
        if recompute != "full":
            adjusted += layer_norm_statistics_bytes(S, B, TP, sequence_parallel=sequence_parallel)
        ratio = measured / adjusted
        print(f"TP={TP} sequence_parallel={sequence_parallel} recompute={recompute}: {measured} bytes per layer, "
              f"{measured / (S * B * h):.3f} x sbh; adjusted formula {adjusted:.0f} (ratio {ratio:.4f}); the "
              f"paper's fp16 number {paper:.0f} (ratio {measured / paper:.3f})")
        assert 0.99 <= ratio <= 1.01
        output.sum().backward()
        assert x.grad is not None
