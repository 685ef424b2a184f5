"""Token dispatchers: from each token's routing to the experts that hold its chosen experts, and back.

Both start the same way. The routing map [T, E] is read expert by expert: the (token, expert) pairs sorted by expert
(Megatron's ``permute``), the tokens copied in that order. Both end the same way too: each pair's expert output,
times its routing weight, is added into its token's row (``unpermute``). In between, with expert parallelism:

- ``alltoall`` (default): a rank's E / EP experts are consecutive, so the sorted pairs are already grouped by the
  rank that holds their expert. One all-to-all of counts tells every rank how many rows it will receive for each of
  its experts from each rank; an uneven ``all_to_all_single`` sends the rows; they are regrouped from (source rank,
  expert) to (expert, source rank) for the experts, regrouped back, and returned by the reverse all-to-all. Each
  rank sends k x T rows and receives about as many (exactly, with balanced routing): traffic 2 x k x T x hidden
  per layer forward and the same backward (each all-to-all's backward is the reverse all-to-all).
- ``allgather``: every rank all-gathers the tokens, their weights and routing map over EP (EP x T rows), computes
  its own experts' share of every token's output, and a reduce-scatter sums the shares back, each rank keeping its
  tokens. The gather's backward is a reduce-scatter (each rank used a different part of the gathered weights and
  tokens), the reduce-scatter's an all-gather. Traffic (EP - 1) x T x hidden per collective, whatever k.

Without expert parallelism both are the permutation, the experts and the unpermutation, with no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.parallel_state import GroupInfo
from megalite.tensor_parallel.mappings import conjugate

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has only the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], info: GroupInfo) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=info.group)
    return out


def _all_gather(x: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0, in rank order."""
    out = x.new_empty((info.size * x.shape[0], *x.shape[1:]))
    _all_gather_flat(out, x.contiguous(), group=info.group)
    return out


def _reduce_scatter(x: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """The sum of every rank's ``x``, keeping this rank's slice of dim 0."""
    out = x.new_empty((x.shape[0] // info.size, *x.shape[1:]))
    _reduce_scatter_flat(out, x.contiguous(), group=info.group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, info):
        ctx.splits, ctx.info = (output_splits, input_splits), info
        return _all_to_all(x, output_splits, input_splits, info)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.info), None, None, None


def split_sizes_to_host(counts: torch.Tensor) -> list[int]:
    """The MoE layer's one host read per micro-batch: the (token, expert) pair counts that size its splits and its
    all-to-alls, from which every other size is derived on the host. It waits for the device, so it is the only
    one; a simulation on ``meta`` tensors (which hold no values) replaces this function with balanced counts."""
    return counts.tolist()


def permute(tokens: torch.Tensor, routing: torch.Tensor, routing_map: torch.Tensor, pairs: int):
    """The ``pairs`` (token, expert) pairs of ``routing_map`` [T, E] sorted by expert (by token within an expert):
    (their token rows, their weights, their token indices). A stable sort puts the chosen entries of the
    expert-major map first, in order: boolean indexing would do the same, but asks the host for its size."""
    by_expert = routing_map.t().reshape(-1)
    chosen = torch.argsort((~by_expert).to(torch.uint8), stable=True)[:pairs]
    token_ids = chosen % routing_map.shape[0]
    return tokens.index_select(0, token_ids), routing.t().reshape(-1)[chosen], token_ids


def unpermute(out: torch.Tensor, weights: torch.Tensor, token_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum each pair's output times its weight into its token's row: [num_tokens, hidden]."""
    rows = out.new_zeros((num_tokens, out.shape[-1]))
    return rows.index_add(0, token_ids, out * weights.unsqueeze(-1))


def _reorder(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    chunks = x.split(sizes)
    return torch.cat([chunks[i] for i in order])


def dispatch_and_combine(kind: str, tokens: torch.Tensor, routing: torch.Tensor, routing_map: torch.Tensor,
                         experts) -> torch.Tensor:
    """The MoE output [T, hidden] of ``tokens`` [T, hidden] routed by ``routing`` / ``routing_map`` [T, E] through
    ``experts`` (this rank's :class:`~megalite.model.experts.LocalExperts`), dispatched as ``kind`` says."""
    info = parallel_state.get_expert_model_parallel_group()
    if info.size > 1 and kind == "allgather":
        return _all_gather_and_reduce_scatter(tokens, routing, routing_map, experts, info)
    counts = routing_map.sum(dim=0)   # pairs per expert
    if info.size > 1:
        return _all_to_all_experts(tokens, routing, routing_map, counts, experts, info)
    sizes = split_sizes_to_host(counts)
    rows, weights, token_ids = permute(tokens, routing, routing_map, sum(sizes))
    return unpermute(experts(rows, sizes, counts), weights, token_ids, tokens.shape[0])


def _all_to_all_experts(tokens, routing, routing_map, counts: torch.Tensor, experts, info: GroupInfo) -> torch.Tensor:
    """Send the expert-sorted rows to the ranks of their experts, run the local experts, send the outputs back."""
    ep = info.size
    per_rank = counts.numel() // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=info.group)   # [source rank, local expert] row counts
    host = split_sizes_to_host(torch.cat([counts, received]))      # this rank's counts, then the received ones
    sent, sizes = host[:counts.numel()], host[counts.numel():]
    sends = [sum(sent[r * per_rank:(r + 1) * per_rank]) for r in range(ep)]
    receives = [sum(sizes[s * per_rank:(s + 1) * per_rank]) for s in range(ep)]
    per_expert = [sum(sizes[s * per_rank + e] for s in range(ep)) for e in range(per_rank)]
    rows, weights, token_ids = permute(tokens, routing, routing_map, sum(sent))
    x = _AllToAll.apply(rows, receives, sends, info)
    by_expert = [s * per_rank + e for e in range(per_rank) for s in range(ep)]     # (source, expert) -> (expert, source)
    by_source = [e * ep + s for s in range(ep) for e in range(per_rank)]
    out = experts(_reorder(x, sizes, by_expert), per_expert, received.view(ep, per_rank).sum(dim=0))
    out = _reorder(out, [sizes[i] for i in by_expert], by_source)
    return unpermute(_AllToAll.apply(out, sends, receives, info), weights, token_ids, tokens.shape[0])


def _all_gather_and_reduce_scatter(tokens, routing, routing_map, experts, info: GroupInfo) -> torch.Tensor:
    """Gather every rank's tokens, compute this rank's experts' share of each output, reduce-scatter the shares."""
    all_tokens = conjugate(tokens, info, _all_gather, _reduce_scatter)
    all_routing = conjugate(routing, info, _all_gather, _reduce_scatter)
    all_map = _all_gather(routing_map.to(torch.uint8), info).bool()   # gloo gathers no bools
    local = slice(experts.first, experts.first + len(experts))
    local_map = all_map[:, local]
    counts = local_map.sum(dim=0)
    sizes = split_sizes_to_host(counts)
    rows, weights, token_ids = permute(all_tokens, all_routing[:, local], local_map, sum(sizes))
    shares = unpermute(experts(rows, sizes, counts), weights, token_ids, all_tokens.shape[0])
    return conjugate(shares, info, _reduce_scatter, _all_gather)
