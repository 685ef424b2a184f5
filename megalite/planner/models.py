"""The model a plan is for: a ``configs/model`` group file, explicit sizes, or both (sizes override the file)."""

from __future__ import annotations

import dataclasses

from megalite.config import ConfigError, ModelConfig
from megalite.config.flags import compose, group_options, override


def model_names() -> list[str]:
    """The configs/model group choices (``model=NAME``)."""
    return group_options("model")


def load_model_config(name: str | None = None, **overrides) -> ModelConfig:
    """ModelConfig of ``configs/model/NAME.yaml`` (the dataclass defaults without a name), with ``overrides``
    (ModelConfig field names: ``num_layers=80``; None leaves a field alone), composed and type-checked as the command
    line's ``model=NAME model.num_layers=80`` would be."""
    if name is not None and name not in model_names():
        raise ConfigError(f"no model config {name!r}; choose one of {', '.join(model_names())}")
    settings = [override(f"model.{key}", value) for key, value in overrides.items() if value is not None]
    return compose(([f"model={name}"] if name else []) + settings).model


def with_seq_length(model: ModelConfig, seq_length: int | None) -> ModelConfig:
    """The model trained on ``seq_length``-token samples (positions follow unless the table is set larger)."""
    if seq_length is None or seq_length == model.seq_length:
        return model
    return dataclasses.replace(model, seq_length=seq_length)
