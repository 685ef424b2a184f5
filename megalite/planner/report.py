"""A plan for people (a table, the reasons, the command line) and for scripts (``to_json``)."""

from __future__ import annotations

import dataclasses
import shlex
from typing import Optional

from megalite.cli import FLAGS
from megalite.config import ModelConfig
from megalite.planner.hardware import GiB
from megalite.planner.memory import StageMemory
from megalite.planner.models import load_model_config
from megalite.planner.parameters import count_parameters
from megalite.planner.search import Estimate, Plan

_RECOMPUTE_FIELDS = {"recompute_granularity", "recompute_method", "recompute_num_layers"}


def model_flags(model: ModelConfig, model_name: Optional[str]) -> list[str]:
    """``model=NAME`` plus a flag per field that differs from that file (or the dataclass defaults)."""
    base = load_model_config(model_name) if model_name else ModelConfig()
    argv = [f"model={model_name}"] if model_name else []
    for f in dataclasses.fields(ModelConfig):
        value = getattr(model, f.name)
        if f.name in _RECOMPUTE_FIELDS or value == getattr(base, f.name):
            continue
        if isinstance(value, bool) or value is None:   # a switch only turns on; anything else is an override
            argv.append("--" + f.name.replace("_", "-") if value is True
                        else f"model.{f.name}={'null' if value is None else 'false'}")
        else:
            argv += ["--" + f.name.replace("_", "-"), str(value)]
    return argv


def pretrain_argv(plan: Plan, estimate: Estimate) -> list[str]:
    """pretrain_gpt.py's arguments for ``estimate``'s layout (data options are the user's to add)."""
    argv = model_flags(plan.model, plan.model_name)
    argv += ["--global-batch-size", str(plan.global_batch_size)]
    argv += ["--bf16"] if plan.dtype_bytes == 2 else []
    return argv + estimate.layout.flags()


def hydra_overrides(argv: list[str]) -> list[str]:
    """The same arguments as Hydra overrides (``parallel.tensor_model_parallel_size=8``)."""
    by_flag = {f.flag: f for f in FLAGS}
    result, i = [], 0
    while i < len(argv):
        flag = by_flag.get(argv[i])
        if flag is None:
            result.append(argv[i])
        elif flag.is_switch:
            result.append(f"{flag.key}=true")
        else:
            i += 1
            result.append(f"{flag.key}={argv[i]}")
        i += 1
    return result


def command_line(plan: Plan, estimate: Optional[Estimate] = None) -> str:
    """The torchrun command that trains with the winner (or ``estimate``'s layout)."""
    estimate = estimate or plan.winner
    hw = plan.hardware
    nodes = max(1, hw.num_gpus // hw.gpus_per_node)
    launcher = ["torchrun", "--nproc_per_node", str(min(hw.num_gpus, hw.gpus_per_node))]
    if nodes > 1:
        launcher[1:1] = ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", "$MASTER_ADDR:29500"]
    words = launcher + ["pretrain_gpt.py"] + pretrain_argv(plan, estimate)
    return " ".join(w if w.startswith("$") else shlex.quote(w) for w in words)


# ---- text -----------------------------------------------------------------------------------------------------------

def _g(value: float) -> str:
    return f"{value / GiB:.1f}"


def _seconds(value: float) -> str:
    return "-" if value == 0 else f"{value:.2g}"


_HEADER = ("#", "TP", "PP", "V", "DP", "mbs", "optimizer", "SP", "recompute", "weights", "grads", "optim", "gather",
           "activ", "total", "TP s", "PP s", "DP s", "bubble", "step s", "tokens/s", "MFU")


def _row(i: int, e: Estimate, plan: Plan) -> tuple[str, ...]:
    lay, peak, t = e.layout, e.peak, e.time
    return (str(i), str(lay.tp), str(lay.pp), str(lay.virtual_stages), str(lay.dp), str(lay.micro_batch_size),
            lay.optimizer_name, "yes" if lay.sequence_parallel else "-", lay.recompute or "-", _g(peak.weights),
            _g(peak.gradients), _g(peak.optimizer), _g(peak.gathered) if peak.gathered else "-",
            _g(peak.activations), _g(peak.total), _seconds(t.tp),
            _seconds(t.pp), _seconds(t.dp_exposed), f"{t.bubble:.1%}" if lay.pp > 1 else "-", f"{t.step:.3g}",
            f"{e.tokens_per_second:,.0f}", f"{e.mfu(plan.hardware):.0%}")


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    left = {6, 8}   # optimizer and recompute names read better left-aligned
    return ["  ".join(cell.ljust(w) if c in left else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
            for row in rows]


def format_plan(plan: Plan, top: int = 10, rejected: int = 12) -> str:
    """The plan as text: inputs, the ranked table, why the winner wins, rejections, the command line."""
    m, hw = plan.model, plan.hardware
    name = plan.model_name or "model"
    lines = [f"{name}: {plan.parameters.total / 1e9:.2f}B parameters ({m.num_layers} layers, hidden "
             f"{m.hidden_size}, {m.num_attention_heads} heads"
             + (f", {m.query_groups} key/value heads" if m.group_query_attention else "")
             + f", ffn {m.ffn_size}, vocabulary {m.vocab_size}), sequence {m.seq_length}, global batch "
             f"{plan.global_batch_size} ({plan.global_batch_size * m.seq_length:,} tokens)",
             f"on {hw.describe()}",
             f"{plan.candidates} layouts estimated, {plan.fitting} fit in {_g(hw.usable_memory_bytes)} GiB "
             f"({hw.memory_headroom:.0%} of the device kept free); the best of each TP x PP x V, fastest first. "
             f"Memory in GiB per GPU on the most loaded stage (gather: ZeRO-3's gathered layers and unsharded "
             f"gradients); TP/PP/DP s: communication per step not hidden behind compute.", ""]
    if plan.ranked:
        rows = [_HEADER] + [_row(i + 1, e, plan) for i, e in enumerate(plan.ranked[:top])]
        lines += _table(rows)
        lines.append("")
    lines += ["Why: " + " ".join(plan.explanation), ""]
    if plan.rejected:
        lines.append("Rejected:")
        lines += [f"  {r.shape}: {r.reason}" for r in plan.rejected[:rejected]]
        if len(plan.rejected) > rejected:
            lines.append(f"  ... and {len(plan.rejected) - rejected} more (--json lists them all)")
        lines.append("")
    if plan.winner is not None:
        lines += ["Run it (add your data options, e.g. --data-path and --tokenizer-model):",
                  "  " + command_line(plan)]
    return "\n".join(lines)


# ---- JSON -----------------------------------------------------------------------------------------------------------

def _memory_json(stage: StageMemory) -> dict:
    return {"pp_rank": stage.pp_rank, "weights_bytes": stage.weights, "gradients_bytes": stage.gradients,
            "optimizer_bytes": stage.optimizer, "gathered_bytes": stage.gathered,
            "activations_bytes": stage.activations, "total_bytes": stage.total,
            "host_weights_bytes": stage.host_weights, "host_gradients_bytes": stage.host_gradients,
            "host_optimizer_bytes": stage.host_optimizer}


def estimate_json(e: Estimate, plan: Plan) -> dict:
    t = e.time
    argv = pretrain_argv(plan, e)
    held = count_parameters(plan.model, e.layout.tp, e.layout.pp, e.layout.virtual_stages).per_stage
    return {"layout": dataclasses.asdict(e.layout), "description": e.layout.describe(),
            "parameters_per_stage": held,   # held by one GPU of each pipeline stage
            "memory": _memory_json(e.peak), "memory_per_stage": [_memory_json(s) for s in e.memory],
            "fits": e.fits,
            "communication_s": {"tp": t.tp, "pp": t.pp, "dp": t.dp, "dp_exposed": t.dp_exposed},
            "compute_s": t.compute, "recompute_s": t.recompute, "bubble": t.bubble, "bubble_s": t.bubble_time,
            "step_s": t.step, "tokens_per_s": e.tokens_per_second, "mfu": e.mfu(plan.hardware),
            "model_flops_per_step": t.model_flops, "pretrain_args": argv, "hydra_overrides": hydra_overrides(argv)}


def to_json(plan: Plan) -> dict:
    hw = plan.hardware
    return {
        "model": {"name": plan.model_name, **dataclasses.asdict(plan.model)},
        "parameters": {"total": plan.parameters.total, "embedding": plan.parameters.embedding,
                       "per_layer": plan.parameters.per_layer},
        "hardware": {**dataclasses.asdict(hw), "intra_node_bytes_per_s": hw.intra_bandwidth,
                     "inter_node_bytes_per_s": hw.inter_bandwidth, "usable_memory_bytes": hw.usable_memory_bytes},
        "global_batch_size": plan.global_batch_size,
        "candidates": plan.candidates, "fitting": plan.fitting,
        "ranked": [estimate_json(e, plan) for e in plan.ranked],
        "why": plan.explanation,
        "rejected": [{"tp": r.tp, "pp": r.pp or None, "virtual_stages": r.virtual_stages, "shape": r.shape,
                      "reason": r.reason} for r in plan.rejected],
        "command": command_line(plan) if plan.winner else None,
    }
