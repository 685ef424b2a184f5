"""Each tensor-parallel layer equals its serial torch counterpart: outputs, input gradients, weight gradients.

fp32 on CPU; the only differences are summation order inside the all-reduces, so each tensor matches within 1e-5 of its
largest magnitude (``helpers.REL_TO_SCALE`` says what that allows for).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite import parallel_state
from megalite.tensor_parallel import (ColumnParallelLinear, Fp8Recipe, Partition, RowParallelLinear,
                                      VocabParallelEmbedding, shard, update_delayed_scales,
                                      vocab_parallel_cross_entropy)

from ..helpers import assert_close_to_scale
from ..tensor_parallel.fp8_reference import reference
from .groups import layout

TP_SIZES = [2, 4]


def _tp():
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _load_full(param, full):
    rank, world = _tp()
    with torch.no_grad():
        param.copy_(shard(full, param.partition, rank, world))


def _my_shard(param, full):
    rank, world = _tp()
    return shard(full, param.partition, rank, world)


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("fused", [1, 3])
def test_column_parallel_linear(tp, fused):
    torch.manual_seed(0)   # same full tensors on every rank
    x = torch.randn(2, 5, 16, requires_grad=True)
    w, b = torch.randn(24, 16, requires_grad=True), torch.randn(24, requires_grad=True)
    grad_out = torch.randn(2, 5, 24)
    (F.linear(x, w, b) * grad_out).sum().backward()
    expected = F.linear(x, w, b).detach()
    with layout(tp):
        layer = ColumnParallelLinear(16, 24, init_std=0.02, fused=fused)
        _load_full(layer.weight, w.detach())
        _load_full(layer.bias, b.detach())
        rank, world = _tp()
        # The output stays split: this rank's columns of each fused block (e.g. its heads' q, k and v).
        output_partition = Partition(dim=2, fused=fused)
        x_parallel = x.detach().clone().requires_grad_()
        y = layer(x_parallel)
        (y * shard(grad_out, output_partition, rank, world)).sum().backward()
        assert_close_to_scale(y, shard(expected, output_partition, rank, world))
        assert_close_to_scale(x_parallel.grad, x.grad)
        assert_close_to_scale(layer.weight.grad, _my_shard(layer.weight, w.grad))
        assert_close_to_scale(layer.bias.grad, _my_shard(layer.bias, b.grad))


@pytest.mark.parametrize("tp", TP_SIZES)
def test_column_parallel_linear_gathered_output(tp):
    torch.manual_seed(4)
    x, w = torch.randn(3, 16), torch.randn(24, 16)
    with layout(tp):
        layer = ColumnParallelLinear(16, 24, init_std=0.02, bias=False, gather_output=True)
        _load_full(layer.weight, w)
        assert_close_to_scale(layer(x), F.linear(x, w))


@pytest.mark.parametrize("tp", TP_SIZES)
def test_row_parallel_linear(tp):
    torch.manual_seed(1)
    x = torch.randn(2, 5, 24, requires_grad=True)
    w, b = torch.randn(16, 24, requires_grad=True), torch.randn(16, requires_grad=True)
    grad_out = torch.randn(2, 5, 16)
    (F.linear(x, w, b) * grad_out).sum().backward()
    expected = F.linear(x, w, b).detach()
    with layout(tp):
        layer = RowParallelLinear(24, 16, init_std=0.02, input_is_parallel=False)
        _load_full(layer.weight, w.detach())
        _load_full(layer.bias, b.detach())
        x_parallel = x.detach().clone().requires_grad_()
        y = layer(x_parallel)
        (y * grad_out).sum().backward()
        assert_close_to_scale(y, expected)
        assert_close_to_scale(x_parallel.grad, x.grad)
        assert_close_to_scale(layer.weight.grad, _my_shard(layer.weight, w.grad))
        assert_close_to_scale(layer.bias.grad, b.grad)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_vocab_parallel_embedding(tp):
    vocab, padded, dim = 301, 512, 8
    torch.manual_seed(2)
    ids = torch.randint(vocab, (3, 7))
    table = torch.randn(vocab, dim, requires_grad=True)
    grad_out = torch.randn(3, 7, dim)
    (F.embedding(ids, table) * grad_out).sum().backward()
    with layout(tp):
        layer = VocabParallelEmbedding(vocab, padded, dim, init_std=0.02)
        _load_full(layer.weight, table.detach())
        y = layer(ids)
        (y * grad_out).sum().backward()
        assert_close_to_scale(y, F.embedding(ids, table).detach())
        assert_close_to_scale(layer.weight.grad, _my_shard(layer.weight, table.grad))


@pytest.mark.parametrize("tp", TP_SIZES)
def test_vocab_parallel_cross_entropy_ignores_padding(tp):
    vocab, padded = 301, 512
    torch.manual_seed(3)
    logits = torch.randn(6, padded, requires_grad=True)
    target = torch.randint(vocab, (6,))
    grad_out = torch.rand(6)
    expected = F.cross_entropy(logits[:, :vocab], target, reduction="none")
    (expected * grad_out).sum().backward()
    with layout(tp):
        rank, world = _tp()
        local = logits.detach().chunk(world, dim=-1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, vocab)
        (loss * grad_out).sum().backward()
        assert_close_to_scale(loss, expected.detach())
        # Padded columns get exactly zero gradient (logits.grad is zero there too: they were sliced away).
        assert_close_to_scale(local.grad, logits.grad.chunk(world, dim=-1)[rank])


@pytest.mark.parametrize("tp", TP_SIZES)
def test_sequence_parallel_column_then_row_linear(tp):
    """Input and output split along the sequence (dim 1): all-gather in, reduce-scatter out; the same numbers as
    serial, each rank's slice of the sequence."""
    torch.manual_seed(5)
    x = torch.randn(2, 8, 16, requires_grad=True)
    a, a_bias = torch.randn(24, 16, requires_grad=True), torch.randn(24, requires_grad=True)
    b, b_bias = torch.randn(16, 24, requires_grad=True), torch.randn(16, requires_grad=True)
    grad_out = torch.randn(2, 8, 16)
    expected = F.linear(torch.tanh(F.linear(x, a, a_bias)), b, b_bias)
    (expected * grad_out).sum().backward()
    with layout(tp):
        rank, world = _tp()
        column = ColumnParallelLinear(16, 24, init_std=0.02, sequence_parallel=True)
        row = RowParallelLinear(24, 16, init_std=0.02, sequence_parallel=True)
        for param, full in [(column.weight, a), (column.bias, a_bias), (row.weight, b), (row.bias, b_bias)]:
            _load_full(param, full.detach())
        x_local = x.detach().chunk(world, dim=1)[rank].clone().requires_grad_()
        y = row(torch.tanh(column(x_local)))
        (y * grad_out.chunk(world, dim=1)[rank]).sum().backward()
        assert_close_to_scale(y, expected.detach().chunk(world, dim=1)[rank])
        assert_close_to_scale(x_local.grad, x.grad.chunk(world, dim=1)[rank])
        for param, full in [(column.weight, a), (column.bias, a_bias), (row.weight, b)]:
            assert_close_to_scale(param.grad, _my_shard(param, full.grad))
        # The replicated bias saw only this rank's tokens: flagged so the data-parallel engine sums it over TP.
        assert row.bias.sequence_parallel and not getattr(column.bias, "sequence_parallel", False)
        summed = row.bias.grad.clone()
        torch.distributed.all_reduce(summed, group=parallel_state.get_tensor_model_parallel_group().group)
        assert_close_to_scale(summed, b_bias.grad)



def _fp8_case(kind: str, sequence_parallel: bool, recipe: Fp8Recipe):
    """An FP8 linear (32 -> 48 column-parallel, 48 -> 32 row-parallel) holding its slice of a full weight, full
    input and output-gradient tensors, and what this rank holds of each: (layer, x, w, g, mine) where ``mine`` cuts
    a full [2, 8, n] tensor to this rank's part of the input ("x") or of the output ("y")."""
    rank, world = _tp()
    gen = torch.Generator().manual_seed(7)
    inputs, outputs = (32, 48) if kind == "column" else (48, 32)
    x = torch.randn(2, 8, inputs, generator=gen) * torch.linspace(0.1, 3, inputs)   # uneven columns
    w = torch.randn(outputs, inputs, generator=gen) * 0.05
    g = torch.randn(2, 8, outputs, generator=gen) * 1e-3
    if kind == "column":
        layer = ColumnParallelLinear(inputs, outputs, init_std=0.02, bias=False, sequence_parallel=sequence_parallel,
                                     fp8=recipe)
    else:   # under sequence parallelism a row-parallel input is the column-parallel output: split by columns
        layer = RowParallelLinear(inputs, outputs, init_std=0.02, bias=False, input_is_parallel=sequence_parallel,
                                  sequence_parallel=sequence_parallel, fp8=recipe)
    _load_full(layer.weight, w)
    columns = lambda t: t.chunk(world, dim=-1)[rank]                                     # noqa: E731
    sequence = (lambda t: t.chunk(world, dim=1)[rank]) if sequence_parallel else (lambda t: t)   # noqa: E731
    parts = ({"x": sequence, "y": columns} if kind == "column" else
             {"x": columns if sequence_parallel else (lambda t: t), "y": sequence})
    return layer, x, w, g, lambda which, t: parts[which](t).clone()


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_fp8_linears_match_the_float64_reference(recipe, fmt):
    """TP=2, column- and row-parallel, with and without sequence parallelism: the scales are those of the whole
    tensors (amaxes maxed over TP), so each rank's part equals the float64 reference of the single product
    (tests/tensor_parallel/fp8_reference.py) within fp32 rounding (1e-5 of the largest magnitude). Delayed: a second
    pass scales from the history, whose entry, maxed over TP by update_delayed_scales, is the whole tensors' amax."""
    with layout(2):
        for kind in ("column", "row"):
            for sequence_parallel in (False, True):
                layer, x, w, g, mine = _fp8_case(kind, sequence_parallel, Fp8Recipe(fmt, recipe))
                for step in range(2 if recipe == "delayed" else 1):
                    x_local = mine("x", x).requires_grad_()
                    layer.weight.grad = None
                    y = layer(x_local)
                    y.backward(mine("y", g))
                    amaxes = None if step == 0 else (x.abs().max(), w.abs().max(), g.abs().max())
                    y_ref, dx_ref, dw_ref = reference(x.reshape(-1, x.shape[-1]), w, g.reshape(-1, g.shape[-1]),
                                                      "rowwise" if recipe == "rowwise" else "tensorwise", fmt,
                                                      amaxes=amaxes)
                    assert_close_to_scale(y, mine("y", y_ref.float().reshape(g.shape)))
                    assert_close_to_scale(x_local.grad, mine("x", dx_ref.float().reshape(x.shape)))
                    assert_close_to_scale(layer.weight.grad, _my_shard(layer.weight, dw_ref.float()))
                    if recipe == "delayed":
                        update_delayed_scales([("layer", layer.fp8_history)],
                                              [parallel_state.get_tensor_model_parallel_group()])
                        whole = torch.stack([x.abs().max(), w.abs().max(), g.abs().max()]).float()
                        assert torch.equal(layer.fp8_history.history[:, 0], whole), (kind, sequence_parallel)
