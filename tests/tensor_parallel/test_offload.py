"""Activation offloading (megalite.tensor_parallel.offload) in one process on the CPU, where the offload is a copy
into a new host storage: a tiny GPT and a tiny MoE with dropout on, every --offload-modules part offloaded (with
--recompute-modules layernorm and moe_act for the MoE: a rerun part offloads its inputs), against the same model
without offloading: the loss and every gradient bit for bit; after the forward the autograd graph keeps none of the
storages the parts saved (each one freed: the graph holds the offloader's copies), and each part handed some over.
A linear under offloading still hands its weight gradient to the weight's main-gradient accumulator.
The bytes saved against the planner's prediction: tests/planner/test_memory.py."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from megalite.model.gpt import GPTModel
from megalite.tensor_parallel import ActivationOffloader, RowParallelLinear, TensorParallelRNG
from megalite.tensor_parallel.weight_grad import MAIN_GRAD_ACCUMULATOR

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


def test_a_linear_under_offloading_still_adds_its_weight_gradient_into_the_main_gradient():
    """Under saved-tensor hooks a saved tensor comes back as a new tensor object, without the parameter's attributes:
    the linear keeps its weight itself, so gradient-accumulation fusion (the data-parallel engine's accumulator on
    the weight) still gets the weight gradient, the same as without offloading, instead of losing it."""
    linear = RowParallelLinear(8, 4, init_std=0.1, bias=False)
    torch.nn.init.normal_(linear.weight, generator=torch.Generator().manual_seed(1))
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    added = []
    setattr(linear.weight, MAIN_GRAD_ACCUMULATOR, lambda grad, total_input: added.append(grad.t() @ total_input))
    offloader = ActivationOffloader(frozenset({"attn_proj"}))
    for name in ("mlp_norm", "attn_proj"):   # not offloaded, then offloaded
        with offloader.offloading(name, training=True):
            y = linear(x * 1.0)   # a non-leaf input: offloaded
        y.square().sum().backward()
    assert offloader.offloaded["attn_proj"][0] == 1 and linear.weight.grad is None
    assert len(added) == 2 and torch.equal(added[0], added[1])
