"""Muon against AdamW side by side: the loss after N steps on the built-in corpus, and the optimizer step's time.

One process, a tiny GPT (4 layers, hidden 128, 4 heads, 128 tokens, the corpus's 4096-piece vocabulary), the same
seed, data and learning-rate schedule for both (lr 3e-3, cosine to 3e-4 after 30 warm-up steps, weight decay 0.1):
``--optimizer muon`` steps the hidden matrices with Muon at AdamW's learning rate (its default scale matches
AdamW's update RMS) and the rest with AdamW. The runs alternate step by step (so the machine's load hits both alike);
each optimizer step is timed alone (``MegaliteOptimizer.step``: clipping, the update, the write-back), and the
ratio is the median of per-step ratios Muon / AdamW. Prints a table, writes it to ``--output`` (markdown) and the
loss curves to ``--plot`` (docs/images/muon_vs_adamw.png).

    python bench/muon_bench.py [--steps 300] [--output bench/muon_results.md] [--plot docs/images/muon_vs_adamw.png]

About 4 minutes on 2 idle CPU cores for 300 steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (puts this checkout first on the path)
import torch

from megalite import parallel_state
from megalite.config import (DataConfig, LoggingConfig, MegaliteConfig, ModelConfig, OptimizerConfig,
                             ParallelConfig, TrainingConfig)
from megalite.training import Trainer

CPU = torch.device("cpu")


def config(optimizer: str, steps: int) -> MegaliteConfig:
    return MegaliteConfig(
        model=ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128,
                          hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(),
        optimizer=OptimizerConfig(optimizer=optimizer, lr=3e-3, min_lr=3e-4, lr_warmup_iters=30, weight_decay=0.1,
                                  adam_beta2=0.95),
        data=DataConfig(eval_interval=0),
        training=TrainingConfig(micro_batch_size=8, global_batch_size=8, train_iters=steps, seed=1234),
        logging=LoggingConfig(log_interval=10 ** 9))


class TimedSteps:
    """Wraps a trainer's optimizer step, keeping each call's seconds."""

    def __init__(self, trainer: Trainer):
        self.seconds: list[float] = []
        step = trainer.optimizer.step

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = step(*args, **kwargs)
            self.seconds.append(time.perf_counter() - start)
            return result
        trainer.optimizer.step = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--output", default="bench/muon_results.md")
    parser.add_argument("--plot", default="docs/images/muon_vs_adamw.png")
    args = parser.parse_args()
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(1, 1)
    trainers = {name: Trainer.on_registered_layout(config(name, args.steps), CPU) for name in ("adam", "muon")}
    timers = {name: TimedSteps(trainer) for name, trainer in trainers.items()}
    losses: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(args.steps):
        for name, trainer in trainers.items():
            losses[name].append(trainer.train_step()["loss"])
    window = 20   # the loss at the end: mean of the last steps (one batch is noisy)
    final = {name: statistics.fmean(values[-window:]) for name, values in losses.items()}
    ratios = [m / a for m, a in zip(timers["muon"].seconds[5:], timers["adam"].seconds[5:])]
    ms = {name: 1e3 * statistics.median(timer.seconds[5:]) for name, timer in timers.items()}
    # Steps AdamW needs to reach Muon's final loss (smoothed the same way), if it does.
    smoothed = [statistics.fmean(losses["adam"][max(0, i - window + 1): i + 1]) for i in range(args.steps)]
    reached = next((i + 1 for i, value in enumerate(smoothed) if value <= final["muon"]), None)
    lines = [f"# Muon against AdamW: tiny GPT on the built-in corpus, {args.steps} steps of 8 x 128 tokens", "",
             "| | AdamW | Muon |", "|---|---|---|",
             f"| loss, mean of the last {window} steps | {final['adam']:.4f} | {final['muon']:.4f} |",
             f"| optimizer step, median ms | {ms['adam']:.2f} | {ms['muon']:.2f} |", "",
             f"Optimizer step time Muon / AdamW: median of per-step ratios {statistics.median(ratios):.2f} "
             f"(IQR {statistics.quantiles(ratios, n=4)[0]:.2f}-{statistics.quantiles(ratios, n=4)[2]:.2f}).",
             f"AdamW reaches Muon's final loss after: {reached if reached else f'more than {args.steps}'} steps."]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.output, "w") as f:
        f.write(text)
    from megalite.visual.figures import new_figure, save
    figure = new_figure(6.4, 3.6)
    axes = figure.add_subplot()
    for name, label in (("adam", "AdamW"), ("muon", "Muon (hidden matrices) + AdamW")):
        smooth = [statistics.fmean(losses[name][max(0, i - 9): i + 1]) for i in range(args.steps)]
        axes.plot(range(1, args.steps + 1), smooth, label=label)
    axes.set_xlabel("step")
    axes.set_ylabel("training loss (mean of 10 steps)")
    axes.set_title("Tiny GPT on the built-in corpus, same lr schedule")
    axes.legend()
    print(f"wrote {args.output} and {save(figure, args.plot)}")


if __name__ == "__main__":
    main()
