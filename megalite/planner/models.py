"""The model a plan is for: a ``configs/model`` group file, explicit sizes, or both (sizes override the file)."""

from __future__ import annotations

import dataclasses

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megalite.cli import config_dir
from megalite.config import ConfigError, ModelConfig


def model_names() -> list[str]:
    """The configs/model group choices (``model=NAME``)."""
    return sorted(p.stem for p in (config_dir() / "model").glob("*.yaml"))


def load_model_config(name: str | None = None, **overrides) -> ModelConfig:
    """ModelConfig of ``configs/model/NAME.yaml`` (the dataclass defaults without a name), with ``overrides``
    (ModelConfig field names: ``num_layers=80``); values are type-checked as the command line's are."""
    node = OmegaConf.structured(ModelConfig)
    try:
        if name is not None:
            path = config_dir() / "model" / f"{name}.yaml"
            if not path.is_file():
                raise ConfigError(f"no model config {name!r}; choose one of {', '.join(model_names())}")
            node = OmegaConf.merge(node, OmegaConf.load(path))
        node = OmegaConf.merge(node, {k: v for k, v in overrides.items() if v is not None})
    except OmegaConfBaseException as error:
        raise ConfigError(f"bad model option: {str(error).splitlines()[0]}") from None
    model = OmegaConf.to_object(node)
    assert isinstance(model, ModelConfig)
    return model


def with_seq_length(model: ModelConfig, seq_length: int | None) -> ModelConfig:
    """The model trained on ``seq_length``-token samples (positions follow unless the table is set larger)."""
    if seq_length is None or seq_length == model.seq_length:
        return model
    return dataclasses.replace(model, seq_length=seq_length)
