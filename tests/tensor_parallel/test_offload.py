"""Activation offloading (megalite.tensor_parallel.offload) in one process on the CPU, where the offload is a copy
into a new host storage: a tiny GPT and a tiny MoE with dropout on, every --offload-modules part offloaded (with
--recompute-modules layernorm and moe_act for the MoE: a rerun part offloads its inputs), against the same model
without offloading: the loss and every gradient bit for bit; after the forward the autograd graph keeps none of the
storages the parts saved (each one freed: the graph holds the offloader's copies), and each part handed some over.
The bytes saved against the planner's prediction: tests/planner/test_memory.py."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from megalite.model.gpt import GPTModel
from megalite.tensor_parallel import ActivationOffloader, TensorParallelRNG

from ..helpers import TINY_MOE, tiny_config

pytestmark = pytest.mark.usefixtures("single_process_layout")   # tests/conftest.py

DENSE = "attn_norm core_attn attn_proj mlp_norm"


def _step(options: dict, packed: list | None = None):
    cfg = tiny_config(model={"hidden_dropout": 0.1, "attention_dropout": 0.1, **options}).model
    torch.manual_seed(0)
    model = GPTModel(cfg, TensorParallelRNG(0, 0, 0, torch.device("cpu")))
    model.initialize(0)
    if packed is not None:   # watch every storage the offloader copies (it keeps parameters as they are)
        pack = model.offloader._pack

        def watched(tensor, *rest):
            saved = pack(tensor, *rest)
            if saved is not tensor:
                packed.append(StorageWeakRef(tensor.untyped_storage()))
            return saved
        model.offloader._pack = watched
    tokens = torch.randint(cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], tokens[:, 1:]).sum()
    alive = None if packed is None else sum(not ref.expired() for ref in packed)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], model.offloader, alive


@pytest.mark.parametrize("options, modules", [
    ({}, DENSE),
    ({**TINY_MOE, "swiglu": True, "recompute_granularity": "selective", "recompute_modules": "layernorm moe_act"},
     DENSE + " expert_fc1 moe_act"),
])
def test_offloading_changes_no_bit_and_the_graph_keeps_none_of_the_saved_storages(options, modules):
    plain_loss, plain_grads, offloader, _ = _step(options)
    assert offloader is None
    packed = []
    loss, grads, offloader, alive = _step({**options, "fine_grained_activation_offloading": True,
                                           "offload_modules": modules}, packed)
    assert isinstance(offloader, ActivationOffloader) and packed and alive == 0
    assert set(offloader.offloaded) == set(modules.split())
    assert all(tensors > 0 and nbytes > 0 for tensors, nbytes in offloader.offloaded.values())
    assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
