"""Context parallelism: every sample's sequence split over the CP ranks, and attention that sees the whole of it.

Which tokens a rank holds (:func:`local_indices`). Causal attention makes late tokens costlier than early ones, so for
``p2p`` and ``allgather`` the sequence is cut into 2 x CP chunks and rank r holds chunks r and 2CP-1-r (Megatron's
load balance: every rank then does the same work). ``a2a`` gives rank r the r-th contiguous 1/CP of the sequence:
each rank attends over the whole sequence for a subset of heads, which is balanced already. Everything else in a
layer (projections, MLP, norms, the loss) is per token and runs on the local tokens unchanged; positions (learned or
rotary) are the tokens' global ones.

A :class:`SequenceShard` says which tokens of the sample this rank holds, their position ids, and, for packed
documents (``--reset-attention-mask``), the document of every token of the sample: a token attends to the tokens at
or before it in its own document. The trainer builds one per micro-batch (every rank has the whole sample, so the
document ids of any other rank's tokens are known locally, nothing to send).

The three attentions (q: [batch, heads, local, d], k and v: [batch, key/value heads, local, d]):

- ``p2p``, ring attention (:class:`_RingAttention`; each block torch's fused flash kernel on the CPU, unfused torch
  ops on a GPU or with documents): the K/V blocks travel around the CP ring in CP - 1 steps; each
  step's send/receive of the next block runs while the current block is computed. Queries accumulate their softmax
  online (a running log-sum-exp per query, Milakov & Gimelshein 2018 / flash attention), so no rank ever holds the
  whole sequence's keys. With the load balance, step 0 is the local causal block, a block from an earlier rank is seen
  whole by all local queries but only through its first chunk, a block from a later rank whole but only by the
  second local chunk: the same work at every step. Backward is a second trip around the ring: K/V travel again, each
  with a dK/dV accumulator that collects every rank's contribution and arrives home after CP sends; a block's
  gradient uses the forward's final output and log-sum-exp, so nothing of the forward is recomputed but one block's
  scores at a time. Traffic per layer and rank: (CP-1) K/V blocks forward, (CP-1) K/V plus CP dK/dV blocks backward.
- ``a2a``, DeepSpeed-Ulysses (:func:`sequence_to_heads`): an all-to-all turns this rank's sequence shard of all heads
  into the whole sequence of 1/CP of the heads; the ordinary attention core runs on it (dropout included); a second
  all-to-all turns the output back. Four all-to-alls per layer forward (q, k, v, output; k and v as one), as many
  backward, each of 1/CP of the local activations leaving the rank ((CP-1)/CP of them).
- ``allgather``: keys and values all-gathered over CP (backward: reduce-scattered) and put in sample order; each
  local chunk attends to the keys up to its own end, causally aligned to that end (no mask tensor: flash attention
  on a GPU; with documents a mask built from the global token indices). Simple, and holds the whole sequence's K/V
  for the layer.
- ``a2a+p2p``, hierarchical (:func:`_hierarchical_attention`; Megatron's, with --hierarchical-context-parallel-sizes
  A P): CP = A x P ranks, A adjacent ones (a node's, on fast links) exchange heads by all-to-all as ``a2a`` does,
  and the P groups run the ``p2p`` ring over the heads each holds. The load-balanced chunks line up: A adjacent CP
  ranks hold chunks r..r+A-1 and their mirrors, which are super-chunk i and its mirror of the ring's 2P, so after
  the all-to-all a rank reorders its tokens into ascending sample order and is rank i of a P-rank ring. The ring's
  traffic crosses the slow links, 1/A of the heads each; the all-to-alls stay inside.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.attention.bias import causal_lower_right

from megalite import parallel_state
from megalite.parallel_state import GroupInfo
from megalite.tensor_parallel import all_gather_over

COMM_TYPES = ("p2p", "a2a", "allgather")
_SEQUENCE = 2   # q, k, v and the core's output are [batch, heads, sequence, head_dim]


def local_indices(length: int, cp: int, cp_rank: int, load_balanced: bool,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """Indices in the sample of the tokens rank ``cp_rank`` holds, ascending: chunks r and 2CP-1-r of 2CP chunks
    (``load_balanced``), else the r-th of CP contiguous shards."""
    if not load_balanced:
        shard = length // cp
        return torch.arange(cp_rank * shard, (cp_rank + 1) * shard, device=device)
    chunk = length // (2 * cp)
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device),
                      torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)])


@functools.lru_cache(maxsize=None)
def device_indices(length: int, cp: int, cp_rank: int, load_balanced: bool, device: torch.device) -> torch.Tensor:
    """:func:`local_indices` made once on ``device`` and shared (read-only): every ring step of every layer and
    micro-batch asks for them, and a fresh tensor each time would be a host-to-device copy each."""
    return local_indices(length, cp, cp_rank, load_balanced, device)


@dataclass(frozen=True)
class SequenceShard:
    """The tokens of each sample this rank holds, and what each of them may attend to."""
    length: int                        # tokens per sample
    indices: torch.Tensor              # [local]: this rank's tokens' indices in the sample, ascending
    positions: torch.Tensor            # [local] or [batch, local] (--reset-position-ids): position ids
    documents: Optional[torch.Tensor]  # [batch, length]: each token's document (--reset-attention-mask); None: one
    comm_type: str = "p2p"
    cp: int = 1
    cp_rank: int = 0
    a2a_size: int = 1   # a2a+p2p: the all-to-all level's ranks
    window: Optional[int] = None   # inside the ring only: the layer's sliding window (see _RingAttention)

    @property
    def load_balanced(self) -> bool:
        return self.comm_type != "a2a"

    def indices_of(self, cp_rank: int) -> torch.Tensor:
        """The sample indices of CP rank ``cp_rank``'s tokens."""
        if cp_rank == self.cp_rank:
            return self.indices
        return device_indices(self.length, self.cp, cp_rank, self.load_balanced, self.indices.device)

    @property
    def moved_positions(self) -> Optional[torch.Tensor]:
        """The position ids where they are not 0, 1, ... of the local tokens (reset per document, or a
        context-parallel shard's global positions); None where they are, so callers keep their plain path."""
        return self.positions if self.cp > 1 or self.positions.dim() == 2 else None

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``x`` [batch, length, ...] (the whole of it without context parallelism)."""
        return x if self.cp == 1 else x[:, self.indices]

    def allowed(self, query: torch.Tensor, key: torch.Tensor, causal: bool = True,
                window: Optional[int] = None) -> Optional[torch.Tensor]:
        """Which keys (sample indices ``key``) each query (sample indices ``query``) may attend to: a boolean
        [batch or 1, 1, queries, keys] mask, None when all of them. ``causal=False`` when every key is known to
        precede every query (then only documents and the ``window`` mask: a query sees itself and the ``window``
        tokens before it)."""
        allowed = None
        if self.documents is not None:
            allowed = (self.documents[:, query].unsqueeze(-1) == self.documents[:, key].unsqueeze(-2)).unsqueeze(1)
        if causal or window is not None:
            distance = query.unsqueeze(-1) - key.unsqueeze(0)
            order = ((distance >= 0) if causal else torch.ones_like(distance, dtype=torch.bool))
            if window is not None:
                order = order & (distance <= window)
            allowed = order[None, None] if allowed is None else allowed & order[None, None]
        return allowed

    def whole_sequence_mask(self, window: Optional[int] = None) -> Optional[torch.Tensor]:
        """The mask of attention over the whole sample (without context parallelism, or inside a2a); None for plain
        causal attention (SDPA's ``is_causal``, the fast path)."""
        if self.documents is None and (window is None or window + 1 >= self.length):
            return None
        device = self.indices.device if self.documents is None else self.documents.device
        everything = torch.arange(self.length, device=device)
        return self.allowed(everything, everything, window=window)


def shard_sequence(length: int, device: torch.device, *, positions: Optional[torch.Tensor] = None,
                   documents: Optional[torch.Tensor] = None, comm_type: str = "p2p",
                   a2a_size: int = 1) -> SequenceShard:
    """This rank's shard of samples of ``length`` tokens under the registered layout's context parallelism.
    ``positions`` [batch, length] (default: the token's index) and ``documents`` [batch, length] are the whole
    sample's."""
    cp, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    indices = device_indices(length, cp, rank, comm_type != "a2a", torch.device(device))
    local_positions = indices if positions is None else (positions if cp == 1 else positions[:, indices])
    return SequenceShard(length, indices, local_positions, documents, comm_type, cp, rank, a2a_size)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard,
                               core: Callable[..., torch.Tensor], scale: Optional[float] = None,
                               window: Optional[int] = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence: [batch, heads, local, d]. ``core(q, k, v, mask)``
    is the layer's own attention core (SDPA with dropout, scaled as the layer says), which ``a2a`` and ``allgather``
    run on their inputs; the ring (``p2p``) scales q k^T by ``scale`` (default 1/sqrt(d)). ``window``: a sliding
    window (each query sees itself and that many tokens before it; see :func:`_window_blocks` for what the ring
    skips)."""
    group = parallel_state.get_context_parallel_group()
    if window is not None and window + 1 >= shard.length:
        window = None   # the window covers the sample: plain causal attention
    if shard.comm_type == "p2p":
        return _RingAttention.apply(q, k, v, shard, group, scale, window)
    if shard.comm_type == "allgather":
        k, v = all_gather_over(torch.cat([k, v], dim=1), _SEQUENCE, group).chunk(2, dim=1)
        if shard.documents is not None or window is not None:   # which keys each query sees, spelled out in a mask
            keys = torch.cat([shard.indices_of(r) for r in range(shard.cp)])
            return core(q, k, v, shard.allowed(shard.indices, keys, window=window))
        return _causal_over_gathered(q, k, v, shard, core)
    if shard.comm_type == "a2a":
        q, k, v = _heads_over(q, k, v, group)
        return heads_to_sequence(core(q, k, v, shard.whole_sequence_mask(window)), group)
    if shard.comm_type == "a2a+p2p":
        return _hierarchical_attention(q, k, v, shard, scale, window)
    raise ValueError(f"unknown context-parallel comm type {shard.comm_type!r}; expected one of {COMM_TYPES}")


# ---- allgather ---------------------------------------------------------------------------------------------------
def _causal_over_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard,
                          core: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Causal attention of the two local chunks over the gathered keys and values, with no mask tensor: the keys
    put in sample order, chunk j (of 2 x CP) attends to the first j + 1 chunks, causally aligned to the end
    (torch's lower-right ``CausalBias``, which SDPA runs as flash or memory-efficient attention on a GPU; on the CPU
    torch spells it out as a mask)."""
    cp, rank = shard.cp, shard.cp_rank
    # Gathered in rank order, rank s holding chunks s and 2CP-1-s: sample chunk j is gathered chunk order[j].
    order = [*range(0, 2 * cp, 2), *range(2 * cp - 1, 0, -2)]
    k, v = (torch.cat([t.chunk(2 * cp, dim=_SEQUENCE)[i] for i in order], dim=_SEQUENCE) for t in (k, v))
    chunk = q.shape[_SEQUENCE] // 2
    outs = []
    for q_chunk, j in zip(q.chunk(2, dim=_SEQUENCE), (rank, 2 * cp - 1 - rank)):
        keys = (j + 1) * chunk
        outs.append(core(q_chunk, k[:, :, :keys], v[:, :, :keys], causal_lower_right(chunk, keys)))
    return torch.cat(outs, dim=_SEQUENCE)


# ---- a2a: Ulysses' all-to-all -----------------------------------------------------------------------------------
def _expand_key_value_heads(k: torch.Tensor, v: torch.Tensor, heads: int, cp: int) -> tuple[torch.Tensor, ...]:
    """Key/value heads repeated (grouped-query attention) until CP divides their number: each CP rank needs the
    key/value heads of its query heads. lcm(G, CP) divides the query heads, since G and CP both do."""
    groups = k.shape[1]
    wanted = groups * cp // math.gcd(groups, cp)
    if wanted == groups:
        return k, v
    assert heads % wanted == 0, (heads, groups, cp)
    return k.repeat_interleave(wanted // groups, dim=1), v.repeat_interleave(wanted // groups, dim=1)


def _heads_over(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                group: GroupInfo) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of this rank's sequence shard of every head -> the group's shards (in rank order) of 1/size of the
    heads: one all-to-all for q, one for keys and values (rank j's part is [its keys, its values])."""
    k, v = _expand_key_value_heads(k, v, q.shape[1], group.size)
    kv_heads = k.shape[1]
    batch, _, local, dim = k.shape
    paired = torch.stack([t.view(batch, group.size, kv_heads // group.size, local, dim) for t in (k, v)], dim=2)
    q, kv = sequence_to_heads(q, group), sequence_to_heads(paired.view(batch, 2 * kv_heads, local, dim), group)
    return q, kv[:, :kv_heads // group.size], kv[:, kv_heads // group.size:]


def _hierarchical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard,
                            scale: Optional[float] = None, window: Optional[int] = None) -> torch.Tensor:
    """a2a+p2p (see the module docstring): heads exchanged inside the a2a group, the ring across the groups."""
    inner, outer = parallel_state.get_hierarchical_context_parallel_groups(shard.a2a_size)
    q, k, v = (_ascending(t, inner.size) for t in _heads_over(q, k, v, inner))
    ring = dataclasses.replace(shard, indices=device_indices(shard.length, outer.size, outer.rank, True, q.device),
                               comm_type="p2p", cp=outer.size, cp_rank=outer.rank, a2a_size=1)
    out = _RingAttention.apply(q, k, v, ring, outer, scale, window)
    return heads_to_sequence(_ascending(out, inner.size, inverse=True), inner)


def _ascending(x: torch.Tensor, ranks: int, inverse: bool = False) -> torch.Tensor:
    """The a2a group's tokens [b, h, ranks x 2 chunks, d], gathered in rank order (each rank's first chunk, then its
    mirror chunk), put in ascending sample order: the first chunks in rank order, then the mirrors in reverse (a
    later rank's mirror comes earlier in the sample); ``inverse`` undoes it."""
    batch, heads, length, dim = x.shape
    chunk = length // (2 * ranks)
    if inverse:
        first, mirrors = x.view(batch, heads, 2, ranks, chunk, dim).unbind(2)
        return torch.stack([first, mirrors.flip(2)], dim=3).reshape(batch, heads, length, dim)
    first, mirrors = x.view(batch, heads, ranks, 2, chunk, dim).unbind(3)
    return torch.cat([first, mirrors.flip(2)], dim=2).reshape(batch, heads, length, dim)


def _all_to_all(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """Send x[j] (the leading dimension has one entry per CP rank) to rank j; entry j of the result came from it."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group.group)
    return out


def _heads_to_sequence(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """[batch, heads / CP, length, d] (the whole sequence of some heads) -> [batch, heads, length / CP, d]."""
    batch, heads, length, dim = x.shape
    n = group.size
    parts = x.view(batch, heads, n, length // n, dim).permute(2, 0, 1, 3, 4)   # [rank, batch, heads, shard, d]
    return _all_to_all(parts, group).permute(1, 0, 2, 3, 4).reshape(batch, heads * n, length // n, dim)


def _sequence_to_heads(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """[batch, heads, length / CP, d] (a sequence shard of every head) -> [batch, heads / CP, length, d]."""
    batch, heads, shard, dim = x.shape
    n = group.size
    parts = x.view(batch, n, heads // n, shard, dim).transpose(0, 1)   # [rank, batch, heads / CP, shard, d]
    return _all_to_all(parts, group).permute(1, 2, 0, 3, 4).reshape(batch, heads // n, n * shard, dim)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inverse):
        ctx.group, ctx.inverse = group, inverse
        return (_heads_to_sequence if inverse else _sequence_to_heads)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_sequence_to_heads if ctx.inverse else _heads_to_sequence)(grad, ctx.group), None, None


def sequence_to_heads(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """All-to-all over CP: [batch, heads, length / CP, d] -> [batch, heads / CP, length, d]; backward the inverse."""
    return _SequenceToHeads.apply(x, group, False)


def heads_to_sequence(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads`."""
    return _SequenceToHeads.apply(x, group, True)


# ---- p2p: ring attention ------------------------------------------------------------------------------------------
def _start_ring_exchange(tensor: torch.Tensor, group: GroupInfo, tag: int) -> tuple[torch.Tensor, list]:
    """Send ``tensor`` to the next CP rank and receive the previous rank's into a new buffer, asynchronously:
    (the buffer, the works to wait for)."""
    n, r = group.size, group.rank
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, group.ranks[(r + 1) % n], group.group, tag),
           dist.P2POp(dist.irecv, received, group.ranks[(r - 1) % n], group.group, tag)]
    return received, dist.batch_isend_irecv(ops)


def _finish(exchange: tuple[torch.Tensor, list]) -> torch.Tensor:
    received, works = exchange
    for work in works:
        work.wait()
    return received


_KV_TAG, _GRAD_TAG = 1, 2   # two exchanges may be in flight at once in backward: keep their messages apart


@dataclass(frozen=True)
class _Block:
    """What step ``i`` of the ring computes: which local queries attend to which keys of the visiting block."""
    rows: slice      # local query positions
    columns: slice   # positions in the visiting K/V block
    causal: bool     # the local block itself (step 0)


def _ring_block(step: int, source: int, rank: int, local: int) -> _Block:
    """With the load-balanced chunks (rank r holds chunks r and 2CP-1-r): the own block is causal; of an earlier
    rank's block (source < rank) every local query sees the first chunk and none the second; of a later rank's
    block only the local second chunk sees anything, and all of it."""
    half = local // 2
    if step == 0:
        return _Block(slice(0, local), slice(0, local), True)
    if source < rank:
        return _Block(slice(0, local), slice(0, half), False)
    return _Block(slice(half, local), slice(0, local), False)


def _sample_index(shard: SequenceShard, cp_rank: int, position: int) -> int:
    """The sample index of local token ``position`` of ring rank ``cp_rank`` (load-balanced chunks), on the host."""
    chunk = shard.length // (2 * shard.cp)
    return cp_rank * chunk + position if position < chunk else (2 * shard.cp - 1 - cp_rank) * chunk + position - chunk


def _visiting_blocks(kv: torch.Tensor, shard: SequenceShard, group: GroupInfo, local: int):
    """The ring's steps, for the caller to compute: (the step's block, its keys' sample indices, K, V, whether the
    layer's window leaves the block without a single allowed pair: its earliest query more than the window after its
    last key, so the caller skips its compute). The next rank's block is in flight while the caller computes on this
    one; the exchange is waited for when it asks for the next."""
    n, rank = group.size, group.rank
    for step in range(n):
        source = (rank - step) % n
        exchange = _start_ring_exchange(kv, group, _KV_TAG) if step + 1 < n else None
        block = _ring_block(step, source, rank, local)
        outside = shard.window is not None and (_sample_index(shard, rank, block.rows.start)
                                                - _sample_index(shard, source, block.columns.stop - 1)) > shard.window
        yield (block, shard.indices_of(source)[block.columns], *kv[:, :, :, block.columns].unbind(0), outside)
        if exchange is not None:
            kv = _finish(exchange)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[batch, heads, L, d] -> [batch, kv heads, heads / kv heads, L, d]: query head i uses key/value head
    i // (heads / kv heads), as SDPA's grouped-query attention."""
    batch, heads, length, dim = q.shape
    return q.view(batch, kv_heads, heads // kv_heads, length, dim)


def _fused_cpu_kernels():
    """torch's CPU flash-attention kernels that return (and take back) the log-sum-exp, which SDPA's public function
    does not expose: (forward, backward), or None on a torch without them."""
    try:
        return (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
    except (AttributeError, RuntimeError):
        return None


_FUSED_CPU = _fused_cpu_kernels()


def _fused(q: torch.Tensor, shard: SequenceShard) -> bool:
    """Whether a block runs as torch's fused CPU kernel: on the CPU, without documents or a window (the kernel's masks
    would have to spell out fully masked rows, which the blockwise softmax then cannot tell from empty ones)."""
    return _FUSED_CPU is not None and q.device.type == "cpu" and shard.documents is None and shard.window is None


def _expanded(k: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for their query heads (the fused kernel has no grouped-query attention)."""
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def _block_forward(q, k, v, shard: SequenceShard, query, key, causal: bool, scale: float, stats: torch.dtype):
    """One block: queries q [b, h, Lq, d] against keys and values [b, G, Lk, d]: (output [b, h, Lq, d], log-sum-exp
    [b, h, Lq]) in the statistics' dtype; a query with no allowed key here gets lse -inf and output 0."""
    if _fused(q, shard):
        heads = q.shape[1]
        out, lse = _FUSED_CPU[0](q, _expanded(k, heads), _expanded(v, heads), 0.0, causal, scale=scale)
        return out.to(stats), lse.to(stats)
    q5 = _grouped(q * scale, k.shape[1])
    scores = _scores(q5, k, shard, query, key, causal, stats)
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
    out = (probs.to(q.dtype) @ v.unsqueeze(2)).to(stats)
    return out.view(q.shape), lse.view(q.shape[:-1])


def _block_backward(grad, q, k, v, out, lse, delta, shard: SequenceShard, query, key, causal: bool, scale: float,
                    stats: torch.dtype):
    """One block's share of the gradients, from the final output and log-sum-exp of its queries: (dq [b, h, Lq, d],
    dk and dv [b, G, Lk, d]) in the statistics' dtype. ``delta``: rowsum(dO * O) [b, h, Lq]."""
    kv_heads = k.shape[1]
    if _fused(q, shard):
        heads = q.shape[1]
        grad_q, grad_k, grad_v = _FUSED_CPU[1](grad, q, _expanded(k, heads), _expanded(v, heads), out, lse, 0.0,
                                               causal, scale=scale)
        batch, _, length, dim = grad_k.shape
        return (grad_q.to(stats), *(g.to(stats).view(batch, kv_heads, heads // kv_heads, length, dim).sum(2)
                                    for g in (grad_k, grad_v)))
    dtype = q.dtype
    q5, grad5 = _grouped(q * scale, kv_heads), _grouped(grad, kv_heads)
    scores = _scores(q5, k, shard, query, key, causal, stats)
    probs = torch.exp(scores - _grouped(lse.unsqueeze(-1), kv_heads))   # the final softmax's entries of this block
    grad_v = (probs.to(dtype).transpose(-1, -2) @ grad5).to(stats).sum(2)
    grad_probs = (grad5 @ v.unsqueeze(2).transpose(-1, -2)).to(stats)
    grad_scores = (probs * (grad_probs - _grouped(delta.unsqueeze(-1), kv_heads))).to(dtype)
    grad_q = (grad_scores @ k.unsqueeze(2)).to(stats) * scale
    grad_k = (grad_scores.transpose(-1, -2) @ q5).to(stats).sum(2)
    return grad_q.view(q.shape), grad_k, grad_v


def _scores(q: torch.Tensor, k: torch.Tensor, shard: SequenceShard, query: torch.Tensor, key: torch.Tensor,
            causal: bool, stats: torch.dtype) -> torch.Tensor:
    """Masked q k^T of one block in the statistics' dtype: [batch, kv heads, group, queries, keys] (q scaled)."""
    scores = (q @ k.unsqueeze(2).transpose(-1, -2)).to(stats)
    allowed = shard.allowed(query, key, causal, shard.window)
    if allowed is not None:
        scores = scores.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    return scores


class _RingAttention(torch.autograd.Function):
    """Ring attention (see the module docstring). Inputs q [b, h, L, d], k and v [b, G, L, d] in any float dtype.
    Each block runs as torch's fused CPU flash-attention kernel where it can (CPU tensors, no documents); otherwise
    as Megatron's unfused attention does: the products in the input dtype (tensor cores for bf16), the softmax
    statistics in fp32. The blocks' outputs and gradients accumulate in fp32 (fp64 inputs keep fp64); K/V blocks
    travel in the input dtype, the dK/dV accumulators in fp32."""

    @staticmethod
    def forward(ctx, q, k, v, shard: SequenceShard, group: GroupInfo, scale: Optional[float] = None,
                window: Optional[int] = None):
        if window is not None:   # a sliding window: blocks wholly outside it are skipped (the K/V still travel)
            shard = dataclasses.replace(shard, window=window)
        batch, heads, local, dim = q.shape
        scale = 1.0 / math.sqrt(dim) if scale is None else scale
        stats = torch.promote_types(q.dtype, torch.float32)
        # Token-major storage [b, L, h, d], as flash attention's output: the caller's merge of the heads
        # ([b, L, h x d], the output projection's input) is then a view of it, not a second copy to keep.
        out = torch.zeros(batch, local, heads, dim, dtype=stats, device=q.device).transpose(1, 2)
        lse = torch.full((batch, heads, local), float("-inf"), dtype=stats, device=q.device)   # per query
        for block, keys, k_block, v_block, outside in _visiting_blocks(torch.stack([k, v]), shard, group, local):
            if outside:
                continue
            rows = block.rows
            block_out, block_lse = _block_forward(q[:, :, rows], k_block, v_block, shard, shard.indices[rows], keys,
                                                  block.causal, scale, stats)
            old_lse = lse[..., rows]
            new_lse = torch.logaddexp(old_lse, block_lse)
            finite = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(old_lse - finite).unsqueeze(-1)
                               + block_out * torch.exp(block_lse - finite).unsqueeze(-1))
            lse[..., rows] = new_lse
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shard, ctx.group, ctx.scale = shard, group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        shard, group, scale = ctx.shard, ctx.group, ctx.scale
        local, stats = q.shape[_SEQUENCE], lse.dtype
        grad_out = grad_out.to(q.dtype)
        delta = (grad_out.to(stats) * out.to(stats)).sum(-1)   # rowsum(dO * O), once per query
        grad_q = torch.zeros(q.shape, dtype=stats, device=q.device)
        kv = torch.stack([k, v])
        grad_exchange = None
        for block, keys, k_block, v_block, outside in _visiting_blocks(kv, shard, group, local):
            rows = block.rows
            if not outside:
                grad_q_block, grad_k_block, grad_v_block = _block_backward(
                    grad_out[:, :, rows], q[:, :, rows], k_block, v_block, out[:, :, rows], lse[..., rows],
                    delta[..., rows], shard, shard.indices[rows], keys, block.causal, scale, stats)
                grad_q[:, :, rows] += grad_q_block
            # The accumulator of the visiting block arrives from the previous rank (which added its share); add ours
            # and pass it on. After CP sends it is back with its owner, complete.
            grad_kv = (torch.zeros(kv.shape, dtype=stats, device=kv.device) if grad_exchange is None
                       else _finish(grad_exchange))
            if not outside:
                grad_kv[0][:, :, block.columns] += grad_k_block
                grad_kv[1][:, :, block.columns] += grad_v_block
            grad_exchange = _start_ring_exchange(grad_kv, group, _GRAD_TAG)
        grad_k, grad_v = _finish(grad_exchange).unbind(0)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None
