"""The model-parallel gradient fix-ups that both engines share (megalite.distributed.finalize): the tied word
embedding's two copies on one rank summed before the data-parallel reduction, the sequence-parallel sum after it,
and offloaded gradients summed on the compute device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megalite import parallel_state
from megalite.distributed import DataParallel, Piece, finalize_model_grads
from megalite.parallel_state import GroupInfo

from ..helpers import meta_only_world

ALONE = GroupInfo(None, (0,))
META = torch.device("meta")


class TwoCopies(torch.nn.Module):
    """The first stage's embedding and the last stage's output layer on one rank (zbv's V): two copies of one
    weight, each used its own way."""

    def __init__(self):
        super().__init__()
        self.embedding, self.output = torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(5, 4))
        self.output.data.copy_(self.embedding.data)

    def forward(self, tokens):
        hidden = torch.tanh(self.embedding[tokens])
        return (hidden @ self.output.t()).logsumexp(dim=-1).sum()


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_two_copies_on_one_rank_are_summed_before_the_reduction(zero):
    """Each copy's gradient becomes the sum of both, bit for bit, whatever the engine keeps it in (the buffer,
    or ZeRO-2's shard accumulator after its reduction of the summed copies), over two micro-batches."""
    torch.manual_seed(0)
    model = TwoCopies()
    reference = TwoCopies()
    reference.load_state_dict(model.state_dict())
    engine = DataParallel([model], data_group=ALONE, zero=zero, tied_params=[model.embedding, model.output])
    batches = [torch.tensor([[0, 3, 1]]), torch.tensor([[4, 4, 2]])]
    engine.zero_grad()
    engine.start_iteration(len(batches))
    for tokens in batches:
        model(tokens).backward()
        reference(tokens).backward()
    engine.finish_grad_sync()
    expected = reference.embedding.grad + reference.output.grad
    grads = {id(piece.param): piece.grad.view_as(piece.param) for piece in engine.pieces()}
    assert torch.equal(grads[id(model.embedding)], expected) and torch.equal(grads[id(model.output)], expected)


def test_the_tied_sum_comes_before_the_data_parallel_reduction_and_the_sequence_parallel_sum_after():
    """The order fixes the rounding: tied copies summed whole, then reduced over DP, then the pieces (reduced)
    summed over TP."""
    events = []
    param = SimpleNamespace(sequence_parallel=True)
    engine = SimpleNamespace(
        params=[param], device=torch.device("cpu"), tied_params=[param, param], embedding_group=None,
        tensor_group=ALONE, tied_gradients=lambda: events.append("tied copies") or [torch.ones(2), torch.ones(2)],
        reduce_data_parallel=lambda: events.append("data-parallel reduction"),
        pieces=lambda: events.append("reduced pieces") or [])
    finalize_model_grads(engine)
    assert events == ["tied copies", "data-parallel reduction", "reduced pieces"]


def _offloaded_engine(group_kind: str) -> SimpleNamespace:
    """An engine as finalize_model_grads reads it, holding one CPU gradient shard (ZeRO-3 with --offload-params)
    to sum over the embedding group (a tied embedding) or the tensor group (a sequence-parallel parameter)."""
    grad = torch.ones(6)
    param = SimpleNamespace(sequence_parallel=group_kind == "tensor")
    return SimpleNamespace(
        params=[param], device=META,
        embedding_group=parallel_state.get_embedding_group() if group_kind == "embedding" else None,
        tied_params=[param] if group_kind == "embedding" else [], tied_gradients=lambda: [grad],
        tensor_group=parallel_state.get_tensor_model_parallel_group() if group_kind == "tensor" else None,
        reduce_data_parallel=lambda: None, pieces=lambda: [Piece(param, 0, 6, grad, grad)])


@pytest.mark.parametrize("group_kind", ["embedding", "tensor"])
def test_offloaded_gradients_are_summed_on_the_compute_device(group_kind):
    """The groups here refuse CPU tensors as NCCL's do and carry "meta" tensors, the compute device."""
    with meta_only_world(4, tp=2, pp=2):   # rank 0: the first stage, with an embedding group and a TP group of 2
        with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):   # the sum ran; the meta
            finalize_model_grads(_offloaded_engine(group_kind))                           # result has no values
