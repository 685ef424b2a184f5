"""The data-parallel engine in one process: gradient accumulation into the fp32 buffer across micro-batches, and a
parameter that gets no gradient in a step (its slice still holds the previous step's, as the buffer is not zeroed
between steps) reduced as zero."""

from __future__ import annotations

import torch

from megalite.distributed import DataParallel
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
