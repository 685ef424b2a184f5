"""Memory per GPU as stacked bars: weights, gradients, optimizer states, ZeRO-3's gathered layers and activations, as
the planner (megalite.planner.memory) estimates them, against the card's memory and the headroom kept free.

``tools/plan_parallelism.py --plot`` draws the most loaded GPU of each of the top layouts, the chosen one first;
``pretrain_gpt.py --dry-run --plot`` one bar per pipeline stage of the layout on its command line. A bar's segments
are exactly the planner's terms (:func:`segments`), so a bar's height is the planner's total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from megalite.planner.hardware import GiB
from megalite.planner.memory import StageMemory
from megalite.visual.figures import new_figure

# (StageMemory field, legend, colour), bottom to top: what stays for the whole run first, activations last.
SEGMENTS = (("weights", "weights", "#4c72b0"), ("gradients", "gradients", "#55a868"),
            ("optimizer", "optimizer states", "#dd8452"), ("gathered", "ZeRO-3 gathered layers", "#937860"),
            ("activations", "activations", "#c44e52"))
CARD_COLOUR = "#333333"


@dataclass(frozen=True)
class Bar:
    label: str
    memory: StageMemory
    chosen: bool = False


def segments(memory: StageMemory) -> list[tuple[str, float]]:
    """(field, bytes) bottom to top; they sum to ``memory.total``."""
    return [(name, float(getattr(memory, name))) for name, _, _ in SEGMENTS]


def layout_label(layout) -> str:
    """A planner Layout in three short lines: ``TP=2 PP=4 V=2`` / ``DP=8 mbs 1`` / ``ZeRO-1 SP sel.``."""
    first = f"TP={layout.tp} PP={layout.pp}" + (f" V={layout.virtual_stages}" if layout.virtual_stages > 1 else "")
    extras = [layout.optimizer_name] + (["SP"] if layout.sequence_parallel else [])
    extras += [{"selective": "sel.", "full": "full rec."}[layout.recompute]] if layout.recompute else []
    return f"{first}\nDP={layout.dp} mbs {layout.micro_batch_size}\n{' '.join(extras)}"


def draw_memory(bars: Sequence[Bar], title: str, card_bytes: Optional[float] = None,
                usable_bytes: Optional[float] = None):
    """The figure: one stacked bar per entry of ``bars`` (in GiB; the chosen one's label in bold), the card's memory
    as a line and the headroom above ``usable_bytes`` shaded. Each segment's gid is ``memory-<bar>-<field>``."""
    width, height = max(6.5, 0.9 * len(bars) + 2.7), 4.4
    figure = new_figure(width, height, constrained=False)   # first: the one-line error without matplotlib
    from matplotlib.patches import Patch

    # Margins in inches: the axis label, the legend on the right, three-line bar labels below, a two-line title.
    left, right, top, bottom = 0.65, 1.75, 0.6, 0.65
    axes = figure.add_axes((left / width, bottom / height, 1 - (left + right) / width, 1 - (top + bottom) / height))
    used = {name for bar in bars for name, value in segments(bar.memory) if value > 0}
    top = max([bar.memory.total for bar in bars] + [card_bytes or 0.0]) / GiB
    for index, bar in enumerate(bars):
        bottom = 0.0
        for name, value in segments(bar.memory):
            if name not in used:
                continue
            colour = next(c for field, _, c in SEGMENTS if field == name)
            patch = axes.bar(index, value / GiB, 0.62, bottom=bottom, color=colour, edgecolor="white",
                             linewidth=0.5)[0]
            patch.set_gid(f"memory-{index}-{name}")
            bottom += value / GiB
        over = usable_bytes is not None and bar.memory.total > usable_bytes
        axes.text(index, bottom + top * 0.01, f"{bottom:.3g}" + (" over" if over else ""), ha="center",
                  va="bottom", fontsize=8, color="#c44e52" if over else "black",
                  fontweight="bold" if bar.chosen else "normal")
    if card_bytes is not None:
        axes.axhline(card_bytes / GiB, color=CARD_COLOUR, linewidth=1.2)
        axes.text(-0.55, card_bytes / GiB, f"card {card_bytes / GiB:.3g} GiB", va="bottom", ha="left", fontsize=8)
    if card_bytes is not None and usable_bytes is not None and usable_bytes < card_bytes:
        axes.axhspan(usable_bytes / GiB, card_bytes / GiB, color="#bbbbbb", alpha=0.35, linewidth=0)
        axes.axhline(usable_bytes / GiB, color=CARD_COLOUR, linewidth=0.8, linestyle="--")
        axes.text(-0.55, usable_bytes / GiB, f"usable {usable_bytes / GiB:.3g} GiB (the rest kept free)",
                  va="top", ha="left", fontsize=7)
    axes.set_xticks(range(len(bars)), [bar.label for bar in bars], fontsize=7)
    for tick, bar in zip(axes.get_xticklabels(), bars):
        if bar.chosen:
            tick.set_fontweight("bold")
    axes.set_xlim(-0.6, len(bars) - 0.4)
    axes.set_ylim(0, top * 1.1)
    axes.set_ylabel("GiB per GPU")
    axes.set_title(title, fontsize=10)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    handles = [Patch(color=c, label=legend) for name, legend, c in reversed(SEGMENTS) if name in used]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return figure


def plan_figure(plan, top: int = 10):
    """The bars of a plan (megalite.planner.search.Plan): the most loaded GPU of each of its ``top`` best layouts,
    the chosen one first, against the plan's card."""
    shown = plan.ranked[:top]
    bars = [Bar(layout_label(e.layout), e.peak, chosen=i == 0) for i, e in enumerate(shown)]
    hw = plan.hardware
    name = plan.model_name or "model"
    title = (f"{name} on {hw.num_gpus} GPUs: memory of the most loaded GPU\nof the {len(bars)} fastest layouts "
             f"that fit (the chosen one in bold)")
    return draw_memory(bars, title, card_bytes=hw.memory_bytes, usable_bytes=hw.usable_memory_bytes)


def stages_figure(layout, stages: Sequence[StageMemory], card_bytes: Optional[float] = None,
                  headroom: float = 0.10):
    """One bar per pipeline stage of ``layout`` (a planner Layout), the most loaded in bold; against ``card_bytes``
    with ``headroom`` of it kept free, when a card is known."""
    peak = max(stages, key=lambda s: s.total)
    bars = [Bar(f"stage {s.pp_rank}", s, chosen=s is peak and len(stages) > 1) for s in stages]
    card = f"this GPU: {card_bytes / GiB:.1f} GiB" if card_bytes else "no GPU here to compare with"
    title = f"memory per GPU: {layout.describe()}\n(DP rank 0, the most loaded stage in bold; {card})"
    usable = card_bytes * (1 - headroom) if card_bytes else None
    return draw_memory(bars, title, card_bytes=card_bytes, usable_bytes=usable)


def draw_dry_run(cfg, world_size: int):
    """``pretrain_gpt.py --dry-run --plot FILE``: the stages of the config's layout (megalite.planner.dry_run's
    estimate, against this GPU with 10% kept free, as the printed table says), saved to FILE; returns its path."""
    import torch

    from megalite.planner.dry_run import run_memory
    from megalite.visual.figures import check_output, save

    path = check_output(cfg.training.plot)
    cuda = torch.cuda.is_available()
    layout, stages = run_memory(cfg, world_size, cuda)
    card = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if cuda else None
    return save(stages_figure(layout, stages, card_bytes=card), path)
