"""The training loop, its logging, and process start-up."""

from megalite.training.initialize import (finish_checks, initialize_distributed, rank_device,
                                         shutdown_distributed, take_save_lock, world_size_from_env)
from megalite.training.trainer import Trainer, TrainState

__all__ = ["Trainer", "TrainState", "finish_checks", "initialize_distributed", "rank_device", "shutdown_distributed",
           "take_save_lock", "world_size_from_env"]
