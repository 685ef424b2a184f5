"""A plan for people (a table, the reasons, the command line) and for scripts (``to_json``)."""

from __future__ import annotations

import dataclasses
import functools
import shlex
from typing import Optional

from megalite.config import MegaliteConfig, flags
from megalite.config.flags import compose
from megalite.planner.hardware import GiB
from megalite.planner.memory import StageMemory
from megalite.planner.parameters import count_parameters
from megalite.planner.search import Estimate, Plan

@functools.lru_cache(maxsize=8)
def _base_config(model_name: Optional[str]) -> MegaliteConfig:
    """What ``pretrain_gpt.py model=NAME`` runs with no other option (the YAML groups' values included)."""
    return compose([f"model={model_name}"] if model_name else [])


def pretrain_settings(plan: Plan, estimate: Estimate) -> dict[str, object]:
    """The options (``section.field`` -> value) that run ``estimate``'s layout, beyond ``model=NAME``'s defaults."""
    base = _base_config(plan.model_name)
    run = dataclasses.replace(base, model=plan.model, training=dataclasses.replace(
        base.training, global_batch_size=plan.global_batch_size, bf16=plan.dtype_bytes == 2))
    return flags.differences(estimate.layout.apply(run), base)


def pretrain_argv(plan: Plan, estimate: Estimate) -> list[str]:
    """pretrain_gpt.py's arguments for ``estimate``'s layout (data options are the user's to add)."""
    group = [f"model={plan.model_name}"] if plan.model_name else []
    return group + flags.argv(pretrain_settings(plan, estimate))


def hydra_overrides(plan: Plan, estimate: Estimate) -> list[str]:
    """The same options as Hydra overrides (``parallel.tensor_model_parallel_size=8``)."""
    group = [f"model={plan.model_name}"] if plan.model_name else []
    return group + [flags.override(key, value) for key, value in pretrain_settings(plan, estimate).items()]


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


_HEADER = ("#", "TP", "CP", "PP", "V", "schedule", "DP", "mbs", "optimizer", "SP", "recompute", "weights", "grads",
           "optim", "gather", "activ", "total", "TP s", "CP s", "PP s", "DP s", "bubble", "step s", "tokens/s", "MFU")


def _row(i: int, e: Estimate, plan: Plan) -> tuple[str, ...]:
    lay, peak, t = e.layout, e.peak, e.time
    return (str(i), str(lay.tp), str(lay.cp) + (f" {lay.cp_comm_type}" if lay.cp > 1 else ""), str(lay.pp),
            str(lay.virtual_stages), lay.pipeline_schedule if lay.pp > 1 else "-", str(lay.dp),
            str(lay.micro_batch_size), lay.optimizer_name, "yes" if lay.sequence_parallel else "-",
            lay.recompute or "-", _g(peak.weights), _g(peak.gradients), _g(peak.optimizer),
            _g(peak.gathered) if peak.gathered else "-", _g(peak.activations), _g(peak.total), _seconds(t.tp),
            _seconds(t.cp_exposed), _seconds(t.pp), _seconds(t.dp_exposed), f"{t.bubble:.1%}" if lay.pp > 1 else "-",
            f"{t.step:.3g}", f"{e.tokens_per_second:,.0f}", f"{e.mfu(plan.hardware):.0%}")


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    left = {5, 8, 10}   # schedule, optimizer and recompute names read better left-aligned
    return ["  ".join(cell.ljust(w) if c in left else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
            for row in rows]


def estimate_lines(estimates: list[Estimate], plan: Plan) -> list[str]:
    """Estimates as rows of the plan's table (memory in GiB per GPU, communication, step time)."""
    return _table([_HEADER] + [_row(i + 1, e, plan) for i, e in enumerate(estimates)])


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
             f"({hw.memory_headroom:.0%} of the device kept free); the best of each TP x CP x PP x V, fastest first. "
             f"Memory in GiB per GPU on the most loaded stage (gather: ZeRO-3's gathered layers and unsharded "
             f"gradients); TP/CP/PP/DP s: communication per step not hidden behind compute.", ""]
    if plan.ranked:
        lines += estimate_lines(plan.ranked[:top], plan)
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
    held = count_parameters(plan.model, e.layout.tp, e.layout.pp, e.layout.virtual_stages,
                            e.layout.placement, split=e.layout.split).per_stage
    return {"layout": dataclasses.asdict(e.layout), "description": e.layout.describe(),
            "parameters_per_stage": held,   # held by one GPU of each pipeline stage
            "memory": _memory_json(e.peak), "memory_per_stage": [_memory_json(s) for s in e.memory],
            "fits": e.fits,
            "communication_s": {"tp": t.tp, "pp": t.pp, "dp": t.dp, "dp_exposed": t.dp_exposed, "cp": t.cp,
                                "cp_exposed": t.cp_exposed},
            "compute_s": t.compute, "recompute_s": t.recompute, "bubble": t.bubble, "bubble_s": t.bubble_time,
            "step_s": t.step, "tokens_per_s": e.tokens_per_second, "mfu": e.mfu(plan.hardware),
            "model_flops_per_step": t.model_flops, "pretrain_args": argv, "hydra_overrides": hydra_overrides(plan, e)}


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
