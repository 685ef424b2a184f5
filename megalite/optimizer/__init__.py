"""AdamW over fp32 main parameters (whole or DP-sharded), loss scaling, LR schedule, global-norm clipping."""

from megalite.optimizer.clip_grads import clip_by_global_norm_, global_grad_norm
from megalite.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler
from megalite.optimizer.lr_schedule import LRSchedule, learning_rate
from megalite.optimizer.optimizer import MegaliteOptimizer

__all__ = ["LRSchedule", "MegaliteOptimizer", "learning_rate", "clip_by_global_norm_", "global_grad_norm",
           "ConstantLossScaler", "DynamicLossScaler"]
