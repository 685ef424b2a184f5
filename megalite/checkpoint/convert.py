"""What ``tools/convert_checkpoint.py`` does: export to / import from a Hugging Face directory, and inspect.

The Hugging Face architecture follows the model: a megalite model using any Llama option (rotary positions, RMSNorm,
SwiGLU, no biases, grouped-query attention) exports as ``LlamaForCausalLM`` (``hf_llama``), any other as
``GPT2LMHeadModel`` (``hf_gpt2``); an import follows the ``model_type`` of config.json (``llama`` or ``gpt2``).

An export merges every parameter to its canonical tensor (whatever layout the checkpoint was saved at) and writes
``config.json`` + ``model.safetensors``; an import reads such a directory into a single-process megalite checkpoint
at iteration 0 (weights only), which ``pretrain_gpt.py --load`` reshards to any layout. Tensors are read with
``safetensors`` (or ``torch.load(weights_only=True)`` for a ``pytorch_model.bin``), never with pickle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from megalite.checkpoint import hf_gpt2, hf_llama, hf_moe
from megalite.checkpoint.contents import Checkpoint, open_checkpoint
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.keys import model_key
from megalite.checkpoint.pretrained import single_process_layout
from megalite.checkpoint.reshard import merge, split
from megalite.checkpoint.save import save_checkpoint
from megalite.config import MegaliteConfig, ModelConfig
from megalite.model import GPTModel

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_PICKLE_WEIGHTS = "pytorch_model.bin"


def full_tensors(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """Every parameter of the checkpoint as its canonical full tensor (one read per parameter)."""
    result = {}
    for name, spec in checkpoint.manifest.params.items():
        keys = [model_key(name, spec.slices, r) for r in range(spec.slices)]
        data = checkpoint.read(keys)
        result[name] = merge([data[k] for k in keys], spec).contiguous()
    return result


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise CheckpointError("Hugging Face conversion needs the safetensors package: pip install safetensors") \
            from None
    return safetensors.torch


def hf_architecture(model: ModelConfig):
    """The conversion module of the HF architecture a megalite model exports as: ``hf_moe`` for a mixture of experts
    (Mixtral, Qwen2-MoE or Qwen3-MoE), ``hf_llama`` if it uses any Llama option (it must then be a whole Llama),
    else ``hf_gpt2``."""
    if model.num_experts is not None:
        return hf_moe
    return hf_llama if hf_llama.is_llama_shaped(model) else hf_gpt2


def export_hf(load: str | os.PathLike, output: str | os.PathLike, dtype: Optional[torch.dtype] = None) -> Path:
    """Write the checkpoint as a ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` directory (see :func:`hf_architecture`);
    returns it. ``dtype`` defaults to the stored one."""
    checkpoint = open_checkpoint(load)
    checkpoint.verify()
    config = checkpoint.manifest.megalite_config()
    architecture = hf_architecture(config.model)
    architecture.check_exportable(config.model)
    tensors = architecture.to_hf(full_tensors(checkpoint), config.model)
    dtype = dtype or next(iter(tensors.values())).dtype
    tensors = {name: t.to(dtype) for name, t in tensors.items()}
    eod = (checkpoint.manifest.tokenizer or {}).get("eod")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    if architecture is not hf_gpt2:
        architecture.write_hf_config(config.model, out, eod, dtype)
    else:
        (out / HF_CONFIG).write_text(json.dumps(hf_gpt2.hf_config_from(config.model, eod, dtype), indent=2) + "\n")
    _safetensors().save_file(tensors, str(out / HF_WEIGHTS), metadata={"format": "pt"})
    return out


def read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The state dict of an HF model directory: one safetensors file, a sharded set, or a weights-only .bin."""
    if (directory / HF_WEIGHTS).is_file():
        return _safetensors().load_file(str(directory / HF_WEIGHTS))
    if (directory / HF_INDEX).is_file():
        index = json.loads((directory / HF_INDEX).read_text())
        tensors = {}
        for shard_file in sorted(set(index["weight_map"].values())):
            tensors.update(_safetensors().load_file(str(directory / shard_file)))
        return tensors
    if (directory / HF_PICKLE_WEIGHTS).is_file():
        return torch.load(directory / HF_PICKLE_WEIGHTS, map_location="cpu", weights_only=True)
    raise CheckpointError(f"{directory}: no {HF_WEIGHTS}, {HF_INDEX} or {HF_PICKLE_WEIGHTS}")


def import_hf(source: str | os.PathLike, save: str | os.PathLike, allow_approximate_gelu: bool = False) -> Path:
    """Turn an HF GPT-2 or Llama directory into a megalite checkpoint (iteration 0, weights only, fp32); returns it.
    ``allow_approximate_gelu`` concerns GPT-2 only (see ``hf_gpt2``)."""
    directory = Path(source)
    if not (directory / HF_CONFIG).is_file():
        raise CheckpointError(f"{directory}: no {HF_CONFIG}")
    try:
        hf = json.loads((directory / HF_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{directory / HF_CONFIG}: unreadable ({error})") from None
    model_type = hf.get("model_type", "gpt2")   # GPT-2 configs of old transformers versions may not say
    if model_type == "llama":
        model = hf_llama.model_config_from(hf)
        canonical = hf_llama.from_hf(read_hf_tensors(directory), model)
    elif model_type == "gpt2":
        model = hf_gpt2.model_config_from(hf, allow_approximate_gelu)
        canonical = hf_gpt2.from_hf(read_hf_tensors(directory), model)
    elif model_type in hf_moe.MODEL_TYPES:
        model = hf_moe.model_config_from(hf)
        canonical = hf_moe.from_hf(read_hf_tensors(directory), model)
    else:
        raise CheckpointError(f"model_type {model_type!r}: only {hf_gpt2.ARCHITECTURE} (gpt2), "
                              f"{hf_llama.ARCHITECTURE} (llama) and {', '.join(hf_moe.MODEL_TYPES.values())} "
                              f"({', '.join(hf_moe.MODEL_TYPES)}) can be imported")
    cfg = MegaliteConfig(model=model)
    with single_process_layout():
        with torch.device("meta"):
            gpt = GPTModel(model)
        parameters = []
        for name, param in gpt.canonical_named_parameters():
            # Real tensors cut from the HF ones (vocabulary padded as a 1-rank layout pads it) carrying the meta
            # parameter's sharding description, which is all the saver reads.
            tensor = torch.nn.Parameter(split(canonical[name].float(), param.partition, 0, 1), requires_grad=False)
            tensor.full_shape, tensor.partition = param.full_shape, param.partition
            parameters.append((name, tensor))
        return save_checkpoint(save, cfg=cfg, iteration=0, consumed_samples=0, parameters=parameters)


def inspect(load: str | os.PathLike) -> str:
    """A human-readable summary: where, iteration, layout, what state is included, config, tensors."""
    checkpoint = open_checkpoint(load)
    m = checkpoint.manifest
    lines = [f"checkpoint: {checkpoint.path}", f"iteration: {m.iteration}", f"consumed samples: {m.consumed_samples}",
             f"saved at: {m.layout.describe()}",
             f"optimizer state: {'yes (Adam step ' + str(m.adam_step) + ')' if m.has_optimizer else 'no'}",
             f"rng state: {', '.join(m.rng_streams) if m.rng_streams else 'no'}"]
    if m.loss_scaler:
        lines.append(f"loss scaler: {json.dumps(m.loss_scaler)}")
    if m.tokenizer:
        lines.append(f"tokenizer: {json.dumps(m.tokenizer)}")
    lines.append("config:")
    for section, values in m.config.items():
        lines.append(f"  {section}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    total = sum(int(torch.Size(spec.full_shape).numel()) for spec in m.params.values())
    lines.append(f"parameters ({len(m.params)} tensors, {total:,} elements), full shapes:")
    width = max(len(name) for name in m.params)
    for name, spec in m.params.items():
        partition = (f"split on dim {spec.partition.dim} into {spec.slices}" if spec.partition.is_sharded
                     else "replicated")
        lines.append(f"  {name:<{width}}  {spec.dtype:<8} {list(spec.full_shape)}  ({partition})")
    lines.append(f"stored tensors: {len(checkpoint.metadata.state_dict_metadata)} (model slices, optimizer ranges, "
                 f"rng states)")
    return "\n".join(lines)
