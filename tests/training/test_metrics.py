"""The training log line's time left: the mean step time of the run so far (each logged window weighted by its
iterations) times the iterations to go; none on evaluation lines, none with --quiet."""

from __future__ import annotations

from megalite.config import LoggingConfig
from megalite.training.metrics import MetricsLogger


def test_the_log_line_ends_with_the_time_left(capsys):
    logger = MetricsLogger(LoggingConfig(log_interval=5), enabled=True, total_iters=20)
    logger.log({"iteration": 5, "loss": 2.0, "elapsed_ms": 1000.0})    # 5 steps of 1 s, 15 to go
    logger.log({"iteration": 5, "eval_loss": 2.5})
    logger.log({"iteration": 15, "loss": 1.9, "elapsed_ms": 3000.0})   # (5 x 1 + 10 x 3) / 15 s a step, 5 to go
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| eta 0:15") and "eta" not in lines[1] and lines[2].endswith("| eta 0:12")
    quiet = MetricsLogger(LoggingConfig(log_interval=5, quiet=True), enabled=True, total_iters=20)
    quiet.log({"iteration": 5, "loss": 2.0, "elapsed_ms": 1000.0})
    assert "eta" not in capsys.readouterr().out
