"""Which layers each pipeline rank holds.

The layer stack is cut into PP x V equal chunks ("virtual stages"). Chunk ``c`` of pipeline rank ``r`` is virtual
stage ``c * PP + r``: chunks go round-robin over the ranks, so with PP=2, V=2 and 8 layers, rank 0 holds layers 0-1
(chunk 0) and 4-5 (chunk 1), rank 1 holds 2-3 and 6-7. The embedding lives on virtual stage 0 (rank 0, chunk 0) and
the output layer and loss on the last one (rank PP-1, chunk V-1). An uneven split is an error, never a silent drop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    """One model chunk of one pipeline rank."""
    virtual_stage: int
    first_layer: int
    num_layers: int
    is_first: bool     # holds the embedding
    is_last: bool      # holds the output layer and the loss


def chunks_of_rank(num_layers: int, pp: int, virtual_stages: int, rank: int) -> list[Chunk]:
    total = pp * virtual_stages
    if num_layers % total:
        raise ValueError(f"num-layers {num_layers} is not divisible by pipeline-model-parallel-size {pp} x "
                         f"virtual stages {virtual_stages} = {total}")
    per_chunk = num_layers // total
    chunks = []
    for c in range(virtual_stages):
        stage = c * pp + rank
        chunks.append(Chunk(stage, stage * per_chunk, per_chunk, stage == 0, stage == total - 1))
    return chunks
