"""How many transformer layers each virtual pipeline stage holds, from Megatron's options for uneven pipelines.

Real models do not divide evenly (DeepSeek-V3 has 61 layers), and the first and last stages carry the embedding and
the output layer with its loss, so users give them fewer layers. Megatron's three ways, all read here:

- ``--decoder-first-pipeline-num-layers F`` / ``--decoder-last-pipeline-num-layers L``: pipeline rank 0 holds F
  layers and the last rank L, each split evenly over its V chunks; the other ranks share the rest evenly.
- ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``: the embedding (the loss)
  counts as one layer of an even split, so virtual stage 0 (the last one) holds one transformer layer fewer.
- ``--pipeline-model-parallel-layout "Et|(tt|)*3,tL"``: every virtual stage spelled out, in virtual-stage order (stage
  ``c * PP + r`` is chunk ``c`` of rank ``r``), ``|`` between stages: ``E`` the embedding (first in stage 0), ``t`` a
  transformer layer, ``m`` a multi-token-prediction layer (last stage only), ``L`` the loss (last in the last stage).
  ``(...)*n`` and ``x*n`` repeat, commas are cosmetic. A stage may hold only the embedding or only the loss.

The result is a tuple of layer counts, one per virtual stage (None: the even split megalite always did), which
:func:`megalite.pipeline.partition.chunks_of_rank` turns into each rank's chunks.
"""

from __future__ import annotations

import re
from typing import Optional

LAYOUT_SYMBOLS = {"E": "embedding", "t": "transformer layer", "m": "multi-token-prediction layer", "L": "loss"}


def parse_layout(text: str) -> list[str]:
    """Megatron's layout string as one string of symbols per virtual stage: "E(t|)*2L" -> ["Et", "tL"]."""
    flat = text.replace(",", "").replace(" ", "")
    for pattern in (r"\(([^()]+)\)\*(\d+)", r"(.)\*(\d+)"):   # (group)*n first, then x*n
        flat = re.sub(pattern, lambda match: match.group(1) * int(match.group(2)), flat)
    stages = flat.split("|")
    unknown = sorted({symbol for stage in stages for symbol in stage} - set(LAYOUT_SYMBOLS))
    if unknown:
        known = ", ".join(f"{symbol} ({name})" for symbol, name in LAYOUT_SYMBOLS.items())
        raise ValueError(f"unknown symbol(s) {' '.join(unknown)}: the layout takes {known}, | between stages, "
                         f"(...)*n and x*n to repeat")
    return stages


def layout_split(text: str, pp: int, num_layers: int, mtp_layers: int = 0) -> tuple[int, ...]:
    """Transformer layers per virtual stage of a layout string, checked as Megatron checks it (ValueError: why)."""
    stages = parse_layout(text)
    if len(stages) % pp:
        raise ValueError(f"has {len(stages)} stages, not a multiple of the pipeline-parallel size {pp}")
    flat = "".join(stages)
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        raise ValueError("must begin with the embedding E, once, in the first stage")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        raise ValueError("must end with the loss L, once, in the last stage")
    if flat.count("t") != num_layers:
        raise ValueError(f"places {flat.count('t')} transformer layers (t), the model has {num_layers}")
    if flat.count("m") != mtp_layers:
        raise ValueError(f"places {flat.count('m')} multi-token-prediction layers (m), the model has {mtp_layers}")
    if "m" in "".join(stages[:-1]) or "t" in stages[-1].partition("m")[2]:
        raise ValueError("megalite runs multi-token-prediction layers (m) in the last stage, after its transformer "
                         "layers (Megatron's stage of their own is not supported)")
    return tuple(stage.count("t") for stage in stages)


def first_last_split(num_layers: int, pp: int, virtual_stages: int, first: Optional[int],
                     last: Optional[int]) -> tuple[int, ...]:
    """Megatron's uneven split: rank 0 holds ``first`` layers and rank PP-1 ``last`` (None: an ordinary rank), each
    over its V chunks; the ranks between share the rest evenly (ValueError: why not)."""
    v = virtual_stages
    ordinary = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if pp < 2:
        raise ValueError("needs a pipeline-parallel size of 2 or more")
    if rest < 0:
        raise ValueError(f"the first and last stages take {(first or 0) + (last or 0)} layers, the model has "
                         f"{num_layers}")
    for name, count in (("first", first), ("last", last)):
        if count is not None and count % v:
            raise ValueError(f"the {name} stage's {count} layers do not split over its {v} virtual stages")
    if ordinary == 0 and rest:
        raise ValueError(f"leave {rest} layer(s) to no stage: the first and last stages must hold all {num_layers}")
    if ordinary and rest % (ordinary * v):
        raise ValueError(f"leave {rest} layers to {ordinary} middle rank(s) x {v} virtual stages, not evenly")

    def per_chunk(rank: int) -> int:
        if rank == 0 and first is not None:
            return first // v
        if rank == pp - 1 and last is not None:
            return last // v
        return rest // (ordinary * v)

    return tuple(per_chunk(stage % pp) for stage in range(pp * v))


def accounted_split(num_layers: int, stages: int, embedding: bool, loss: bool) -> tuple[int, ...]:
    """An even split in which the embedding and/or the loss count as one layer each (ValueError: why not)."""
    total = num_layers + embedding + loss
    if total % stages:
        raise ValueError(f"{num_layers} layers{' + the embedding' if embedding else ''}"
                         f"{' + the loss' if loss else ''} = {total} do not split evenly over {stages} virtual stages")
    split = [total // stages] * stages
    split[0] -= embedding
    split[-1] -= loss
    if min(split) < 0:
        raise ValueError(f"{total} over {stages} virtual stages leaves no layer for the embedding or the loss")
    return tuple(split)


def layout_text(split: tuple[int, ...], mtp_layers: int = 0) -> str:
    """The layout string of a split: (1, 2, 2, 1) -> "Et|tt|tt|tL" (multi-token-prediction layers before the loss)."""
    stages = ["t" * count for count in split]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * mtp_layers + "L"
    return "|".join(stages)
