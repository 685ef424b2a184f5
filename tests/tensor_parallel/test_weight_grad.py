"""Deferred weight gradients: a B step leaves the linear layers' weight gradients to the W step, which gives the
gradients of the plain backward (also with full recompute, whose backward reruns the forward) and fires each
weight's post-accumulate hook then, once per micro-batch."""

from __future__ import annotations

import pytest
import torch

from megalite.model import GPTModel
from megalite.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelRNG, WeightGradStore,
                                      attach_weight_grad_store)

from ..helpers import assert_close_to_scale, single_layout, tiny_config


def _model(**model):
    cfg = tiny_config(model=model).model
    chunk = GPTModel(cfg, TensorParallelRNG(0, 0, 0, torch.device("cpu")))
    chunk.initialize(1234)
    tokens = torch.randint(cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    return chunk, tokens


def _loss(chunk, tokens):
    return chunk(tokens[:, :-1], tokens[:, 1:]).sum()


def _linear_weights(chunk):
    return {id(m.weight) for m in chunk.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None}


@pytest.mark.parametrize("model", [{}, {"recompute_granularity": "full", "recompute_method": "uniform"},
                                   {"swiglu": True, "disable_bias_linear": True, "normalization": "RMSNorm"}])
def test_deferred_weight_gradients_equal_the_plain_backward(model):
    with single_layout():
        chunk, tokens = _model(**model)
        for micro_batch in range(2):
            _loss(chunk, tokens.roll(micro_batch, dims=1)).backward()
        expected = {name: p.grad.clone() for name, p in chunk.named_parameters()}
        chunk.zero_grad(set_to_none=True)

        store = WeightGradStore()
        attach_weight_grad_store(chunk, store)
        linear = _linear_weights(chunk)
        fired = []
        for p in chunk.parameters():
            p.register_post_accumulate_grad_hook(lambda param: fired.append((id(param), param.grad is not None)))
        for micro_batch in range(2):
            with store.deferring(micro_batch):
                _loss(chunk, tokens.roll(micro_batch, dims=1)).backward()
        # After the B steps: every other parameter has its gradient, no linear weight has one, nor was it announced.
        assert {id(p) for p in chunk.parameters() if p.grad is None} == linear
        assert not any(ok and pid in linear for pid, ok in fired)
        assert store.pending() == [0, 1] and store.held_tensors()
        fired.clear()
        for micro_batch in range(2):
            store.run(micro_batch)
        deferred = linear | {id(chunk.output_weight())}   # the output layer's weight is the tied embedding's
        assert sorted(pid for pid, ok in fired if ok) == sorted(list(deferred) * 2)   # once per micro-batch, in W
        assert store.pending() == [] and store.held_tensors() == []
        for name, p in chunk.named_parameters():
            assert_close_to_scale(p.grad, expected[name], rel=1e-6)


def test_outside_a_deferring_block_nothing_is_deferred():
    with single_layout():
        chunk, tokens = _model()
        store = WeightGradStore()
        attach_weight_grad_store(chunk, store)
        _loss(chunk, tokens).backward()
        assert all(p.grad is not None for p in chunk.parameters()) and store.pending() == []
        with store.deferring("a"):
            with pytest.raises(RuntimeError, match="already deferred"):
                with store.deferring("a"):
                    pass
