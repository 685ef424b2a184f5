"""Configuration: the typed schema, its validation, and (imported on their own, since they need Hydra) the command
line (``megalite.config.cli``) and the DeepSpeed translation (``megalite.config.deepspeed``).

``megalite.config.flags`` is the one place that spells a flag or Hydra key from a field; importing this package
loads neither Hydra nor OmegaConf.
"""

from megalite.config.schema import (TOKENIZER_TYPES, CheckpointConfig, ConfigError, DataConfig, KernelConfig,
                                    LoggingConfig, MegaliteConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                                    TrainingConfig, from_dict, option, sections, to_dict)
from megalite.config.validate import validate

__all__ = ["TOKENIZER_TYPES", "CheckpointConfig", "ConfigError", "DataConfig", "KernelConfig", "LoggingConfig",
           "MegaliteConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig", "TrainingConfig", "from_dict", "option",
           "sections", "to_dict", "validate"]
