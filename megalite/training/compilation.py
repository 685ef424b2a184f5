"""--torch-compile: each transformer layer compiled on its own, torchtitan's approach (its ``apply_compile``).

A layer is the unit because every layer of a stage is the same code: one compiled graph serves them all (dynamo
inlines the module and takes its parameters as graph inputs), a pipeline stage compiles only the layers it holds,
and what stays outside a layer (embedding, output layer and loss, multi-token prediction's layers, the schedule,
the data-parallel engine's hooks) runs as before. ``Module.compile`` compiles in place: parameter names, and so
checkpoints and canonical names, are unchanged.

What the compiled layers meet, and how it goes (``tests/training/test_compilation.py`` lists the graph breaks of
dropout, selective recompute and MoE layers, and the training tests there and at TP=2 x PP=2 fail on any in GPT-2
and Llama-style layers; the ZeRO-3, CP and MoE observations below were measured on 2 ranks, not pinned by a test):

- Tensor and sequence parallelism: megalite's TP ops call c10d collectives (``dist.all_reduce``, ``all_gather``,
  ``reduce_scatter``) inside autograd Functions; dynamo rewrites them to functional collectives and traces forward
  and backward: no graph break (the row-parallel sum runs out of place while compiling: dynamo does not trace
  ``mark_dirty``).
- Pipeline stages: a stage compiles its own layers; the p2p sends and receives are outside them.
- Recompute: full recompute wraps compiled layers (its autograd Function runs eagerly and calls them, without
  gradients in forward and with them in backward: two graphs). Selective recompute saves and restores the random
  generators' states, which dynamo does not trace: a graph break at each recomputed module (still correct).
- Dropout: megalite's tensor-parallel dropout stream (megalite.tensor_parallel.random) swaps the generator's state,
  a graph break around each attention dropout and, under sequence parallelism, each residual dropout. Models trained
  without dropout (most LLMs today) compile whole.
- Mixture of experts: routing makes the token counts per expert data (``.tolist()`` for the all-to-all's splits,
  tensors sized by them), a graph break at each; so in an MoE layer only the attention is compiled and the router,
  dispatcher and experts run eagerly, as without --torch-compile.
- ZeRO-3 (FSDP2): ``fully_shard`` comes after compiling, as in torchtitan; the layers compile to one graph without
  a break (checked at DP=2: the same losses as eager, also under full recompute).
- Context parallelism: the ring's (p2p) exchanges are ``batch_isend_irecv``, which dynamo leaves out of graphs
  (P2P compilation is off by default in torch): a graph break at each exchange, the attention compiled in pieces
  between them (checked at CP=2: the same losses as eager).
- The data-parallel engine's gradient-accumulation fusion is off (a compiled backward cannot write into its buckets:
  the weights get ordinary gradients, summed by its hooks), and zero-bubble schedules, which defer weight gradients
  out of a layer's backward, are refused.

Shapes are static (``dynamic=False``): every micro-batch of a run has the same shape, and a static graph is the one
inductor fuses best. Training and evaluation (no gradients) each compile once per distinct layer; nothing is
recompiled from one step to the next.
"""

from __future__ import annotations

from typing import Iterable

import torch

from megalite.model import GPTModel
from megalite.model.moe import MoELayer
from megalite.model.rotary import RotaryEmbedding


def compiled_modules(chunk: GPTModel) -> list[torch.nn.Module]:
    """What --torch-compile compiles in ``chunk``: each transformer layer, or, in an MoE layer, its attention."""
    return [layer.self_attention if isinstance(layer.mlp, MoELayer) else layer for layer in chunk.layers]


def compile_layers(chunks: Iterable[GPTModel], backend: str, seq_length: int, device: torch.device) -> None:
    """Compile ``chunks``' layers in place (see the module doc); compilation itself happens at their first call."""
    for chunk in chunks:
        for module in compiled_modules(chunk):
            # Rotary tables are cached at first use: built now, so the first compiled call does not trace their
            # construction (a cache it filled would fail its guards at the next call: the layer compiled twice).
            for rotary in (m for m in module.modules() if isinstance(m, RotaryEmbedding)):
                rotary.cos_sin(seq_length, device)
            module.compile(backend=backend, dynamic=False)
