"""Which layers each pipeline rank holds.

The layer stack is cut into PP x V chunks ("virtual stages", numbered in layer order): equal ones, or as Megatron's
uneven-pipeline options say (megalite.config.pipeline_split gives the layers of each); a split that does not add up
is an error, never a silent drop. How the chunks go to the ranks is the *placement*:

- ``round-robin`` (Megatron's interleaving): chunk ``c`` of rank ``r`` is virtual stage ``c * PP + r``. With PP=2,
  V=2 and 8 layers, rank 0 holds layers 0-1 (chunk 0) and 4-5 (chunk 1), rank 1 holds 2-3 and 6-7. Activations go
  down the ranks and wrap around from the last rank to the first.
- ``v-shape`` (ZB-V, Qi et al. 2023; exactly 2 chunks per rank): chunk 0 runs the stages down the ranks, chunk 1 back
  up: chunk 0 of rank ``r`` is stage ``r``, chunk 1 is stage ``2 PP - 1 - r``. With PP=2 and 8 layers, rank 0 holds
  layers 0-1 and 6-7, rank 1 holds 2-3 and 4-5; rank 0 has both the embedding and the loss, and the hand-over at
  the bottom of the V stays on the last rank.

The embedding lives on virtual stage 0 and the output layer and loss on the last one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

PLACEMENTS = ("round-robin", "v-shape")


@dataclass(frozen=True)
class Chunk:
    """One model chunk of one pipeline rank."""
    virtual_stage: int
    first_layer: int
    num_layers: int
    is_first: bool     # holds the embedding
    is_last: bool      # holds the output layer and the loss


def _check_placement(placement: str, virtual_stages: int) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")
    if placement == "v-shape" and virtual_stages != 2:
        raise ValueError(f"the v-shape placement holds exactly 2 chunks per rank, got {virtual_stages}")


def virtual_stage(rank: int, chunk: int, pp: int, placement: str = "round-robin") -> int:
    """The virtual stage that chunk ``chunk`` of pipeline rank ``rank`` runs."""
    if placement == "v-shape":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def stage_rank(stage: int, pp: int, placement: str = "round-robin") -> int:
    """The pipeline rank holding virtual stage ``stage``."""
    if placement == "v-shape":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def chunks_of_rank(layers: int | Sequence[int], pp: int, virtual_stages: int, rank: int,
                   placement: str = "round-robin") -> list[Chunk]:
    """Pipeline rank ``rank``'s chunks: ``layers`` is the model's layer count, split evenly over PP x V virtual stages,
    or the layers of each virtual stage (ParallelConfig.pipeline_split)."""
    _check_placement(placement, virtual_stages)
    total = pp * virtual_stages
    if isinstance(layers, int):
        if layers % total:
            raise ValueError(f"num-layers {layers} is not divisible by pipeline-model-parallel-size {pp} x "
                             f"virtual stages {virtual_stages} = {total}")
        layers = [layers // total] * total
    if len(layers) != total:
        raise ValueError(f"{len(layers)} stage sizes for pipeline-model-parallel-size {pp} x virtual stages "
                         f"{virtual_stages} = {total}")
    chunks = []
    for c in range(virtual_stages):
        stage = virtual_stage(rank, c, pp, placement)
        chunks.append(Chunk(stage, sum(layers[:stage]), layers[stage], stage == 0, stage == total - 1))
    return chunks
