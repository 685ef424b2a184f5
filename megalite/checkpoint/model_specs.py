"""Every parameter of the whole model, by canonical name, without building it: read off a model on the meta device.

A rank holds only its pipeline stage, but a checkpoint describes (when saving) and must fit (when loading) the
whole model. Building the full GPT on the meta device costs no memory and no communication, so every rank gets the
same answer on its own and a checkpoint that does not fit stops every rank alike, before any collective.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megalite import parallel_state
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.manifest import Manifest
from megalite.config import ModelConfig
from megalite.config.schema import MODEL_DEFINING
from megalite.model import GPTModel
from megalite.tensor_parallel import Partition


@dataclasses.dataclass(frozen=True)
class ParameterSpec:
    full_shape: tuple[int, ...]
    partition: Partition      # at the registered tensor-parallel size
    optimized: bool = True    # stepped by the optimizer (False: state kept like a parameter, e.g. an expert bias)


def model_parameters(model: ModelConfig) -> dict[str, ParameterSpec]:
    """Canonical name -> spec of every parameter of the full model at the registered layout's TP size (and its
    experts' TP size), every expert included whatever the expert-parallel size."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    experts_tp = parallel_state.get_expert_tensor_parallel_world_size()
    with parallel_state.simulated_layout(tp, etp=experts_tp):   # no group is used
        with torch.random.fork_rng(devices=[]), torch.device("meta"):   # nothing drawn, nothing allocated
            gpt = GPTModel(model)
    return {name: ParameterSpec(tuple(p.full_shape), p.partition, isinstance(p, torch.nn.Parameter))
            for name, p in gpt.canonical_named_parameters()}


def check_fits(manifest: Manifest, model: ModelConfig, where: Path) -> None:
    """Raise CheckpointError unless the checkpoint holds exactly the model's parameters, with the same full shapes."""
    expected = model_parameters(model)
    problem = None
    missing = [name for name in expected if name not in manifest.params]
    unexpected = [name for name in manifest.params if name not in expected]
    if missing:
        problem = f"it has no {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    elif unexpected:
        problem = f"this model has no {unexpected[0]}" + (
            f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
    else:
        for name, spec in expected.items():
            saved = manifest.params[name].full_shape
            if saved != spec.full_shape:
                problem = f"{name} is {list(saved)} there, {list(spec.full_shape)} here"
                break
    if problem is None:
        return
    saved_model = manifest.config.get("model", {})
    differences = [f"{key} {saved_model[key]} (checkpoint) vs {getattr(model, key)}" for key in MODEL_DEFINING
                   if key in saved_model and saved_model[key] != getattr(model, key)]
    hint = f"; model options differ: {', '.join(differences)}" if differences else ""
    raise CheckpointError(f"{where}: does not fit this model: {problem}{hint}")


def check_options_mapped(model: ModelConfig, mapped_fields: set[str], architecture: str, family: str) -> None:
    """Raise CheckpointError naming the first model-defining option a conversion to ``architecture`` does not map
    (not in ``mapped_fields``) that differs from its default: the converted model would compute something else.
    How the model was trained (dropout, FP8, recompute, ...) does not matter to the converted weights."""
    defaults = ModelConfig()
    for name in MODEL_DEFINING:
        value = getattr(model, name)
        if name not in mapped_fields and value != getattr(defaults, name):
            raise CheckpointError(f"cannot export as {architecture}: model option {name}={value!r} has no {family} "
                                  f"counterpart")
