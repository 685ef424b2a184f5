"""What rank 0 reports each logged iteration: a console line, the metrics file, TensorBoard.

The metrics file is a contract for tools and tests: one JSON object per line, with at least ``iteration`` (1-based),
``loss`` (mean LM loss over the global batch), ``grad_norm``, ``lr``, ``consumed_samples``, ``elapsed_ms`` (per
iteration, averaged over the log interval) and ``tokens_per_sec``; evaluations add objects with ``eval_loss``. Lists
(per pipeline stage, per MoE layer) become one TensorBoard scalar per entry.
"""

from __future__ import annotations

import json

from megalite.config import LoggingConfig


class MetricsLogger:
    def __init__(self, cfg: LoggingConfig, enabled: bool, total_iters: int):
        self.enabled = enabled
        self.total_iters = total_iters
        self.metrics_path = cfg.metrics_file if enabled else None
        self.tensorboard = None
        if enabled and cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter   # imported lazily: it is slow to import
            self.tensorboard = SummaryWriter(log_dir=cfg.tensorboard_dir)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        print(self._console_line(record), flush=True)
        if self.metrics_path:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for key, value in self._scalars(record):
                self.tensorboard.add_scalar(key, value, record["iteration"])

    @staticmethod
    def _scalars(record: dict):
        """(tag, number) pairs of a record: its numbers, and each entry of its lists of numbers as ``key/i`` (an MoE
        layer's ``key/layer_N``, N from ``moe_layers``)."""
        for key, value in record.items():
            if key in ("iteration", "moe_layers"):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield key, value
            elif isinstance(value, list):
                labels = ([f"layer_{n}" for n in record["moe_layers"]] if key.startswith("moe_")
                          else [str(i) for i in range(len(value))])
                yield from ((f"{key}/{label}", v) for label, v in zip(labels, value) if isinstance(v, (int, float)))

    def print(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def _console_line(self, record: dict) -> str:
        parts = [f"iteration {record['iteration']:>6}/{self.total_iters}"]
        for key, fmt in [("consumed_samples", "{:d}"), ("elapsed_ms", "{:.1f}"), ("lr", "{:.3e}"),
                         ("loss", "{:.6f}"), ("grad_norm", "{:.4f}"), ("tokens_per_sec", "{:.0f}"),
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
        return " | ".join(parts)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()

