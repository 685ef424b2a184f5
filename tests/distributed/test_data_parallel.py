"""The data-parallel engine in one process: gradient accumulation into the fp32 buffer across micro-batches, and a
parameter that gets no gradient in a step (its slice still holds the previous step's, as the buffer is not zeroed
between steps) reduced as zero; the order of gathers and reductions."""

from __future__ import annotations

import pytest
import torch

from megalite.distributed import DataParallel, data_parallel
from megalite.parallel_state import GroupInfo

ALONE = GroupInfo(None, (0,))


class TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        return (self.a(x) + (self.b(x) if use_b else 0)).square().sum()


def _step(engine: DataParallel, model: TwoBranches, batches, use_b: bool) -> None:
    engine.zero_grad()
    engine.start_iteration(len(batches))
    for x in batches:
        model(x, use_b).backward()
    engine.finish_grad_sync()


def test_gradients_accumulate_and_unused_parameters_reduce_as_zero():
    torch.manual_seed(0)
    model = TwoBranches()
    engine = DataParallel([model], data_group=ALONE)
    batches = [torch.randn(3, 4) for _ in range(3)]
    _step(engine, model, batches, use_b=True)
    reference = TwoBranches()
    reference.load_state_dict(model.state_dict())
    for x in batches:
        reference(x, True).backward()
    for mine, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.main_grad, expected.grad, rtol=1e-6, atol=1e-6)
    _step(engine, model, batches, use_b=False)   # b gets no gradient this step
    assert all(bool((p.main_grad == 0).all()) for p in model.b.parameters())
    assert all(bool(p.main_grad.abs().sum() > 0) for p in model.a.parameters())


class Permuted(torch.nn.Module):
    """Four layers that forward runs in another order than they are defined in (as a model's blocks may)."""
    ORDER = (2, 0, 3, 1)

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        for i in self.ORDER:
            x = torch.tanh(self.layers[i](x))
        return x.square().sum()


@pytest.mark.parametrize("overlap_grad_reduce", [True, False])
def test_gathers_go_in_the_order_forward_needs_and_reductions_in_the_order_backward_finishes(
        overlap_grad_reduce, monkeypatch):
    """With --overlap-param-gather each forward wait is on the oldest gather in flight (the first layer's
    parameters arrive first); reductions are launched as backward finished the buckets. Collectives are recorded
    fakes over a DP group of two, one bucket per layer."""
    torch.manual_seed(0)
    model = Permuted()
    engine = DataParallel([model], data_group=GroupInfo(None, (0, 1)), zero=1, bucket_size=20,
                          overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=True)
    layer_of_bucket = {b.index: next(i for i, layer in enumerate(model.layers) if layer.weight is b.params[-1])
                       for b in engine.buckets}
    events = []

    class Work:
        def __init__(self, kind, layer):
            self.kind, self.layer = kind, layer

        def wait(self):
            events.append(("wait " + self.kind, self.layer))

    def layer_of(buffer, flat):
        offset = (flat.data_ptr() - buffer.data_ptr()) // flat.element_size()
        return layer_of_bucket[next(b.index for b in engine.buckets if b.start == offset)]

    def reduce_scatter(out, full, group, async_op):
        out.copy_(full[:out.numel()])
        events.append(("launch reduction", layer_of(engine.grad_buffer, full)))
        return Work("reduction", events[-1][1]) if async_op else None

    def all_gather(out, local, group, async_op):
        events.append(("launch gather", layer_of(engine.param_buffer, out)))
        return Work("gather", events[-1][1])

    monkeypatch.setattr(data_parallel, "_reduce_scatter", reduce_scatter)
    monkeypatch.setattr(data_parallel, "_all_gather", all_gather)
    x = torch.randn(3, 4)
    for _ in range(2):
        engine.zero_grad()
        engine.start_iteration(1)
        model(x).backward()
        engine.finish_grad_sync()
        engine.gather_params()   # what the distributed optimizer does after its step
    model(x)
    forward, backward = list(Permuted.ORDER), list(reversed(Permuted.ORDER))
    reductions = [layer for kind, layer in events if kind == "launch reduction"]
    assert reductions == backward * 2
    gathers = [layer for kind, layer in events if kind == "launch gather"]
    waits = [layer for kind, layer in events if kind == "wait gather"]
    assert gathers == forward * 2 and waits == forward * 2


@pytest.mark.usefixtures("single_process_layout")
def test_gradient_accumulation_fusion_writes_main_grad_without_hooks_and_still_reduces_each_bucket(monkeypatch):
    """The linears' own weights get dA added into the buffer by their backward: no param.grad, no hook, the same
    summed gradients over 3 micro-batches and 2 steps as the hooks give (1e-6 relative: one addmm rounds once where
    mm + add round twice), and every bucket's overlapped reduction launched during backward."""
    from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    def build(fusion: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(ColumnParallelLinear(8, 16, bias=True, init_std=0.1), torch.nn.Tanh(),
                                    RowParallelLinear(16, 8, bias=True, init_std=0.1))
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(std=0.3)
        return model, DataParallel([model], data_group=GroupInfo(None, (0, 1)), zero=1, bucket_size=100,
                                   overlap_grad_reduce=True, gradient_accumulation_fusion=fusion)

    launched = []

    def reduce_scatter(out, full, group, async_op):   # a work that is already done
        launched.append(full.numel())
        out.copy_(full[:out.numel()])

    monkeypatch.setattr(data_parallel, "_reduce_scatter", reduce_scatter)
    summed = {}
    for fusion in (False, True):
        model, engine = build(fusion)
        weights = {id(model[0].weight), id(model[2].weight)}
        assert engine.fused == (weights if fusion else set()) and len(engine._hooks) == 4 - len(engine.fused)
        for step in range(2):
            engine.zero_grad()
            engine.start_iteration(3)
            launched.clear()
            for i in range(3):
                torch.manual_seed(10 + i + step)
                model(torch.randn(5, 8)).square().sum().backward()
                assert all(p.grad is None for p in model.parameters())
            assert len(launched) == len(engine.buckets) == 2   # both, during the last backward
            engine.finish_grad_sync()
        summed[fusion] = [p.main_grad.clone() for p in model.parameters()]
    for fused, hooked in zip(summed[True], summed[False]):
        assert float((fused - hooked).abs().max() / hooked.abs().max()) <= 1e-6


class Experts(torch.nn.Module):
    """Like megalite.model.experts.LocalExperts: its own forward reads its children's weights (stacked_parameters),
    whose modules never run."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4, bias=False) for _ in range(2)])

    def stacked_parameters(self):
        return [[expert.weight for expert in self.experts]]

    def forward(self, x):
        return torch.stack([expert.weight for expert in self.experts]).matmul(x).square().sum()


def test_the_experts_forward_waits_for_the_gather_of_their_parameters():
    model = Experts()
    engine = DataParallel([model], data_group=ALONE, zero=1, overlap_param_gather=True)
    model(torch.randn(4, 3))
    assert engine._forward_order == [engine.plan.bucket_of[id(model.experts[0].weight)]]
