"""What rank 0 reports each logged iteration: a console line, the metrics file, TensorBoard, Weights & Biases.

The metrics file is a contract for tools and tests: one JSON object per line, with at least ``iteration`` (1-based),
``loss`` (mean LM loss over the global batch), ``grad_norm``, ``lr``, ``consumed_samples``, ``elapsed_ms`` (per
iteration, averaged over the log interval) and ``tokens_per_sec``; evaluations add objects with ``eval_loss``. Lists
(per pipeline stage, per MoE layer) become one scalar per entry in TensorBoard and Weights & Biases.

With ``--wandb-project`` the same numbers go to Weights & Biases (``wandb.log`` with the iteration as step, the run's
config as the run's config) when the ``wandb`` package is installed (``pip install 'megalite[wandb]'``); without it
the run says so in one line and goes on. ``WANDB_MODE=offline`` keeps the run in ``--wandb-save-dir`` for
``wandb sync``.
With ``--eod-mask-loss`` or ``--sft``, ``loss_tokens`` is the number of tokens the loss averaged over (console too). With ``--mtp-num-layers``,
``mtp_loss`` is multi-token prediction's loss, the mean over its depths (``mtp_losses``: each depth's, with more than
one), beside ``loss``, which stays the language-model loss.

The console line ends with the time left, ``eta``: the mean step time of the run so far times the iterations to go
(evaluations and checkpoints not counted); ``--quiet`` leaves it out.
"""

from __future__ import annotations

import json
from typing import Optional

from megalite.config import LoggingConfig, MegaliteConfig, to_dict
from megalite.progress import MeanStepTime, format_duration


def _scalars(record: dict) -> dict[str, float]:
    """The numbers of a record by tag: its numbers, and each entry of its lists of numbers as ``key/i`` (an MoE
    layer's ``key/layer_N``, N from ``moe_layers``)."""
    scalars = {}
    for key, value in record.items():
        if key in ("iteration", "moe_layers"):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            scalars[key] = value
        elif isinstance(value, list):
            labels = ([f"layer_{n}" for n in record["moe_layers"]] if key.startswith("moe_")
                      else [str(i) for i in range(len(value))])
            scalars.update({f"{key}/{label}": v for label, v in zip(labels, value) if isinstance(v, (int, float))})
    return scalars


class MetricsLogger:
    def __init__(self, cfg: LoggingConfig, enabled: bool, total_iters: int,
                 run_config: Optional[MegaliteConfig] = None):
        self.enabled = enabled
        self.total_iters = total_iters
        self.metrics_path = cfg.metrics_file if enabled else None
        self.log_interval, self.step_time = cfg.log_interval, None if cfg.quiet else MeanStepTime()
        self._last_timed: int | None = None   # the iteration of the last timed record
        self.tensorboard = None
        if enabled and cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter   # imported lazily: it is slow to import
            self.tensorboard = SummaryWriter(log_dir=cfg.tensorboard_dir)
        self.wandb = self._start_wandb(cfg, run_config) if enabled and cfg.wandb_project else None

    @staticmethod
    def _start_wandb(cfg: LoggingConfig, run_config: Optional[MegaliteConfig]):
        try:
            import wandb   # optional: pip install 'megalite[wandb]'
        except ImportError:
            print(f"megalite: warning: --wandb-project {cfg.wandb_project} needs the wandb package (pip install "
                  f"'megalite[wandb]'): metrics go to the console and the metrics file only", flush=True)
            return None
        return wandb.init(project=cfg.wandb_project, name=cfg.wandb_exp_name, dir=cfg.wandb_save_dir,
                          config=to_dict(run_config) if run_config is not None else None)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._time_steps(record)
        print(self._console_line(record), flush=True)
        if self.metrics_path:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for key, value in _scalars(record).items():
                self.tensorboard.add_scalar(key, value, record["iteration"])
        if self.wandb is not None:
            self.wandb.log(_scalars(record), step=record["iteration"])

    def print(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def _console_line(self, record: dict) -> str:
        parts = [f"iteration {record['iteration']:>6}/{self.total_iters}"]
        for key, fmt in [("consumed_samples", "{:d}"), ("elapsed_ms", "{:.1f}"), ("lr", "{:.3e}"),
                         ("loss", "{:.6f}"), ("loss_tokens", "{:d}"), ("mtp_loss", "{:.6f}"), ("grad_norm", "{:.4f}"), ("tokens_per_sec", "{:.0f}"),
                         ("tflops_per_device", "{:.2f}"), ("mfu", "{:.1%}"), ("peak_memory_gib", "{:.2f}"),
                         ("loss_scale", "{:.1f}"), ("pipeline_bubble", "{:.2f}"), ("eval_loss", "{:.6f}")]:
            if record.get(key) is not None:
                parts.append(f"{key.replace('_', ' ')} {fmt.format(record[key])}")
        if record.get("moe_aux_loss"):
            parts.append(f"moe aux loss {sum(record['moe_aux_loss']):.4f}")
        if record.get("moe_load_max"):   # the most loaded expert of any MoE layer, relative to the mean
            parts.append(f"moe max load {max(m / a for m, a in zip(record['moe_load_max'], record['moe_load_mean'])):.2f}"
                         f"x mean")
        if record.get("skipped"):
            parts.append("skipped (gradient overflow)")
        if self.step_time is not None and "elapsed_ms" in record:
            left = self.step_time.eta(self.total_iters - record["iteration"])
            if left is not None:
                parts.append(f"eta {format_duration(left)}")
        return " | ".join(parts)

    def _time_steps(self, record: dict) -> None:
        """Add a training record's window (the iterations since the last one, at ``elapsed_ms`` each) to the mean."""
        if self.step_time is None or "elapsed_ms" not in record:
            return
        iteration = record["iteration"]
        steps = iteration - self._last_timed if self._last_timed is not None else min(self.log_interval, iteration)
        self._last_timed = iteration
        self.step_time.add(steps, steps * record["elapsed_ms"] / 1000.0)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None

