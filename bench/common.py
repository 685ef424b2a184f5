"""Pieces the benchmarks share: side-by-side timing (ABAB, barrier-started, max over ranks), medians of paired
ratios, world reductions, and the model/optimizer settings both sides of a comparison use.

How a comparison is timed: every side runs one step in turn (ours, peer, ours, peer, ...), each step starting after a
world barrier and lasting the maximum over ranks of the per-rank wall time (a parallel step is done when its slowest
rank is). The ratio is the median over rounds of ours_i / peer_i within each round: neighbouring steps see the same
machine load, so drift from other work on the machine cancels, and the median ignores rounds that a burst hit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

# Benchmark the checkout these scripts live in, not whatever ``megalite`` the environment has installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from megalite.config import (DataConfig, LoggingConfig, MegaliteConfig, ModelConfig, OptimizerConfig,
                             ParallelConfig, TrainingConfig)

CPU = torch.device("cpu")


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def world_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def world_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed(step: Callable[[], object]) -> tuple[float, object]:
    """Run ``step`` starting together on all ranks: (max over ranks of its wall seconds, what it returned)."""
    barrier()
    start = time.perf_counter()
    result = step()
    return world_max(time.perf_counter() - start), result


def alternate(sides: dict[str, Callable[[], object]], warmup: int, iters: int, budget_s: float | None = None,
              min_iters: int = 5) -> dict[str, list[float]]:
    """Time each side's step ``warmup + iters`` times, round-robin (one step of every side per round, the order
    rotating each round so no side always follows the same one); milliseconds of the timed rounds per side.
    With ``budget_s``, stop early once the timed rounds have taken that long (after at least ``min_iters``): every
    rank adds up the same world-max step times, so all stop after the same round."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    spent = 0.0
    for i in range(warmup + iters):
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            seconds, _ = timed(sides[name])
            if i >= warmup:
                times[name].append(seconds * 1e3)
                spent += seconds
        if budget_s is not None and i + 1 - warmup >= min_iters and spent > budget_s:
            break
    return times


def paired_ratio(ours: list[float], peer: list[float]) -> float:
    """Median over rounds of ours_i / peer_i."""
    return statistics.median(o / p for o, p in zip(ours, peer, strict=True))


def ratio_spread(ours: list[float], peer: list[float]) -> tuple[float, float]:
    """Interquartile range (25th, 75th percentile) of the per-round ratios ours_i / peer_i."""
    ratios = sorted(o / p for o, p in zip(ours, peer, strict=True))
    if len(ratios) < 4:
        return ratios[0], ratios[-1]
    q = statistics.quantiles(ratios, n=4)
    return q[0], q[2]


def print_table(lines: list[str], output: str | None) -> None:
    """Rank 0 prints the table (and writes it to ``output``, when given)."""
    table = "\n".join(lines)
    if rank() == 0:
        print(table, flush=True)
        if output:
            with open(output, "w") as file:
                file.write(table + "\n")


def set_threads(ranks_per_machine: int) -> int:
    """Intra-op threads per rank: the machine's cores shared out (4 ranks on 2 cores: 1 each, no fighting)."""
    threads = max(1, (os.cpu_count() or 1) // ranks_per_machine)
    torch.set_num_threads(threads)
    return threads


def load_average() -> float:
    return os.getloadavg()[0]


# ---------------------------------------------------------------------------------------------------------------------
# The model and optimizer settings of every comparison
# ---------------------------------------------------------------------------------------------------------------------

def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model-size options every bench shares; model_config and training_config read them."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024, help="a multiple of 128 x TP: no padding columns")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)


def model_config(args) -> ModelConfig:
    """GPT-2 style (learned positions, LayerNorm, GeLU, biases, tied output layer), fp32, dropout off. The vocabulary
    should be a multiple of 128 x TP so that neither side computes padding columns the other does not."""
    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                       seq_length=args.seq, vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0)


LR, WEIGHT_DECAY, CLIP = 1e-4, 0.01, 1.0   # AdamW(betas 0.9/0.999, eps 1e-8) on both sides, constant learning rate


def training_config(args, *, tp: int = 1, pp: int = 1, virtual: int | None = None, micro_batches: int,
                    dp: int = 1, iters: int = 1000, **optimizer) -> MegaliteConfig:
    """Our Trainer's config for a comparison: the bench model, ``micro_batches`` per DP rank per step."""
    return MegaliteConfig(
        model=model_config(args),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                num_virtual_stages_per_pipeline_rank=virtual),
        optimizer=OptimizerConfig(lr=LR, lr_decay_style="constant", weight_decay=WEIGHT_DECAY, clip_grad=CLIP,
                                  **optimizer),
        data=DataConfig(mock_data=True),
        training=TrainingConfig(micro_batch_size=args.micro_batch,
                                global_batch_size=args.micro_batch * micro_batches * dp, train_iters=iters,
                                seed=args.seed),
        logging=LoggingConfig(log_interval=10**9),
    )


def param_groups(params) -> list[dict]:
    """Our parameter groups: weight decay on matrices, none on biases and norm weights."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]


def adamw(params) -> torch.optim.AdamW:
    """torch's AdamW with our settings and parameter groups."""
    return torch.optim.AdamW(param_groups(params), lr=LR, betas=(0.9, 0.999), eps=1e-8)
