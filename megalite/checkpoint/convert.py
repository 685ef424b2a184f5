"""What ``tools/convert_checkpoint.py`` does: export to / import from a Hugging Face directory, and inspect.

The Hugging Face architecture follows the model: a megalite model using any Llama option (rotary positions, RMSNorm,
SwiGLU, no biases, grouped-query attention, q/k/v biases, per-head q/k norms) exports as ``LlamaForCausalLM``, or
``Qwen2ForCausalLM`` with q/k/v biases, or ``Qwen3ForCausalLM`` with q/k norms, or ``MistralForCausalLM`` when asked
for (``hf_llama``); one using a Gemma option (sandwich norms, scaled embeddings, GeGLU, a local rotary base) as
``Gemma3ForCausalLM`` (``hf_gemma3``); any other as ``GPT2LMHeadModel`` (``hf_gpt2``); an import follows the
``model_type`` of config.json (``gpt2``, ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma3_text``; mixtures of
experts: ``hf_moe``, and ``gpt_oss``: ``hf_gpt_oss``; ``deepseek_v3``: ``hf_deepseek``).

An export merges every parameter to its canonical tensor (whatever layout the checkpoint was saved at) and writes
``config.json`` + ``model.safetensors``, and the tokenizer's files where transformers' AutoTokenizer can read them
(Hugging Face and GPT-2 BPE tokenizers). An import reads such a directory into a single-process megalite checkpoint
at iteration 0 (weights only, plus the directory's tokenizer if it has one), which ``pretrain_gpt.py --load``
reshards to any layout. When the tokenizer has fewer ids than the model's vocab_size (models pad their embedding,
e.g. Qwen2), the import keeps the rows the tokenizer can produce, as Megatron's converter does with its true
vocabulary size: megalite's vocabulary is the tokenizer's. Tensors are read with ``safetensors`` (or
``torch.load(weights_only=True)`` for a ``pytorch_model.bin``), never with pickle.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

import torch

from megalite.checkpoint import hf_deepseek, hf_gemma3, hf_gpt2, hf_gpt_oss, hf_llama, hf_moe
from megalite.checkpoint.contents import Checkpoint, open_checkpoint
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.keys import model_key
from megalite.checkpoint.pretrained import single_process_layout
from megalite.checkpoint.reshard import merge, split
from megalite.checkpoint.save import save_checkpoint
from megalite.checkpoint.tokenizer import hf_tokenizer, saved_tokenizer
from megalite.data.tokenizer import Tokenizer
from megalite.config import MegaliteConfig, ModelConfig
from megalite.model import GPTModel
from megalite.progress import track

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_PICKLE_WEIGHTS = "pytorch_model.bin"


def full_tensors(checkpoint: Checkpoint, progress: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter of the checkpoint as its canonical full tensor (one read per parameter; ``progress``: a bar
    on a terminal counting them)."""
    result = {}
    params = checkpoint.manifest.params
    for name, spec in track(params.items(), "reading the checkpoint", "tensors", total=len(params),
                            enabled=progress):
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


HF_ARCHITECTURES = (hf_gpt2.ARCHITECTURE, *hf_llama.ARCHITECTURES, hf_gemma3.ARCHITECTURE, *hf_moe.MODEL_TYPES.values(),
                    hf_gpt_oss.ARCHITECTURE, hf_deepseek.ARCHITECTURE)
# Canonical tensors with a row per vocabulary entry.
_VOCABULARY_ROWS = ("embedding.word.weight", "output_layer.weight")


def hf_architecture(model: ModelConfig, name: Optional[str] = None) -> str:
    """The HF architecture a megalite model exports as: for a mixture of experts the one its options make it
    (gpt-oss with biases, sinks or quick GeGLU; else Mixtral, Qwen2-MoE or Qwen3-MoE: see hf_moe.architecture); else
    ``name`` if given (one of :data:`HF_ARCHITECTURES`), else Gemma 3 if it uses any Gemma option (see
    hf_gemma3.is_gemma_shaped), else a Llama-family one if it uses any Llama option (it must then be a whole Llama:
    see hf_llama.export_architecture), else ``GPT2LMHeadModel``. Multi-latent attention exports as DeepSeek-V3
    (hf_deepseek)."""
    if model.multi_latent_attention:
        if name not in (None, hf_deepseek.ARCHITECTURE):
            raise CheckpointError(f"a multi-latent-attention model exports as {hf_deepseek.ARCHITECTURE}, not {name}")
        return hf_deepseek.ARCHITECTURE
    if model.num_experts is not None:
        moe = hf_gpt_oss.ARCHITECTURE if hf_gpt_oss.is_gpt_oss_shaped(model) else hf_moe.architecture(model)
        if name not in (None, moe):
            raise CheckpointError(f"a mixture of experts with these options exports as {moe}, not {name}")
        return moe
    if name == hf_gemma3.ARCHITECTURE or (name is None and hf_gemma3.is_gemma_shaped(model)):
        return hf_gemma3.ARCHITECTURE
    if name == hf_gpt2.ARCHITECTURE or (name is None and not hf_llama.is_llama_shaped(model)):
        return hf_gpt2.ARCHITECTURE
    return hf_llama.export_architecture(model, name).name


def export_hf(load: str | os.PathLike, output: str | os.PathLike, dtype: Optional[torch.dtype] = None,
              architecture: Optional[str] = None, progress: bool = True) -> Path:
    """Write the checkpoint as a Hugging Face model directory of ``architecture`` (default: see
    :func:`hf_architecture`), with its tokenizer where AutoTokenizer can read it; returns it. ``dtype`` defaults to
    the stored one; ``progress``: a bar on a terminal while tensors are read."""
    checkpoint = open_checkpoint(load)
    checkpoint.verify()
    model = checkpoint.manifest.megalite_config().model
    name = hf_architecture(model, architecture)
    family = hf_llama.ARCHITECTURES.get(name)
    if name == hf_deepseek.ARCHITECTURE:   # each checked before any tensor is read
        hf_deepseek.check_exportable(model)
        tensors = hf_deepseek.to_hf(full_tensors(checkpoint, progress), model)
    elif name == hf_gpt_oss.ARCHITECTURE:   # each checked before any tensor is read
        hf_gpt_oss.check_exportable(model)
        tensors = hf_gpt_oss.to_hf(full_tensors(checkpoint, progress), model)
    elif name in hf_moe.MODEL_TYPES.values():
        hf_moe.check_exportable(model)
        tensors = hf_moe.to_hf(full_tensors(checkpoint, progress), model)
    elif name == hf_gemma3.ARCHITECTURE:
        hf_gemma3.check_exportable(model)
        tensors = hf_gemma3.to_hf(full_tensors(checkpoint, progress), model)
    elif family is None:
        hf_gpt2.check_exportable(model)
        tensors = hf_gpt2.to_hf(full_tensors(checkpoint, progress), model)
    else:
        hf_llama.check_exportable(model, family)
        tensors = hf_llama.to_hf(full_tensors(checkpoint, progress), model, family)
    dtype = dtype or next(iter(tensors.values())).dtype
    tensors = {tensor_name: t.to(dtype) for tensor_name, t in tensors.items()}
    tokenizer = saved_tokenizer(checkpoint)
    eod = tokenizer.eod if tokenizer is not None else None
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    if name == hf_deepseek.ARCHITECTURE:
        hf_deepseek.write_hf_config(model, out, eod, dtype)
    elif name == hf_gpt_oss.ARCHITECTURE:
        hf_gpt_oss.write_hf_config(model, out, eod, dtype)
    elif name in hf_moe.MODEL_TYPES.values():
        hf_moe.write_hf_config(model, out, eod, dtype)
    elif name == hf_gemma3.ARCHITECTURE:
        hf_gemma3.write_hf_config(model, out, eod, dtype)
    elif family is None:
        (out / HF_CONFIG).write_text(json.dumps(hf_gpt2.hf_config_from(model, eod, dtype), indent=2) + "\n")
    else:
        hf_llama.write_hf_config(model, out, eod, dtype, family)
    _safetensors().save_file(tensors, str(out / HF_WEIGHTS), metadata={"format": "pt"})
    for file_name, contents in (tokenizer.export_files() if tokenizer is not None else {}).items():
        (out / file_name).write_bytes(contents)
    return out


def _read_json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:   # ValueError: bad JSON, or an integer too long
        raise CheckpointError(f"{path}: unreadable ({error})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return data


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    library = _safetensors()
    try:
        return library.load_file(str(path))
    except Exception as error:   # safetensors' own SafetensorError (truncated, bad header), or an OSError
        raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from None


def _load_weights_only(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:   # truncated, not a zip, or pickling an object other than tensors: never unpickled here
        raise CheckpointError(f"{path}: not a weights-only PyTorch state dict (truncated, or it holds objects other "
                              f"than tensors, which megalite does not unpickle)") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointError(f"{path}: not a state dict (names to tensors)")
    return state


def read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The state dict of an HF model directory: one safetensors file, a sharded set, or a weights-only .bin. A file
    that does not read as one is a one-line CheckpointError naming it."""
    if (directory / HF_WEIGHTS).is_file():
        return _load_safetensors(directory / HF_WEIGHTS)
    if (directory / HF_INDEX).is_file():
        weight_map = _read_json_object(directory / HF_INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{directory / HF_INDEX}: no weight_map of tensor names to files")
        tensors = {}
        for shard_file in sorted(set(weight_map.values())):
            if Path(shard_file).name != shard_file or shard_file in ("", ".", ".."):   # never outside the directory
                raise CheckpointError(f"{directory / HF_INDEX}: shard {shard_file!r} is not a file of {directory}")
            tensors.update(_load_safetensors(directory / shard_file))
        return tensors
    if (directory / HF_PICKLE_WEIGHTS).is_file():
        return _load_weights_only(directory / HF_PICKLE_WEIGHTS)
    raise CheckpointError(f"{directory}: no {HF_WEIGHTS}, {HF_INDEX} or {HF_PICKLE_WEIGHTS}")


def import_hf(source: str | os.PathLike, save: str | os.PathLike, progress: bool = True) -> Path:
    """Turn an HF GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 3 (text), Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss or
    DeepSeek-V3 directory into a
    megalite checkpoint (iteration 0, weights only, fp32, with the directory's tokenizer if it has one); returns it.
    ``progress``: a bar on a terminal while the tensors are converted."""
    directory = Path(source)
    if not (directory / HF_CONFIG).is_file():
        raise CheckpointError(f"{directory}: no {HF_CONFIG}")
    hf = _read_json_object(directory / HF_CONFIG)
    model_type = hf.get("model_type", "gpt2")   # GPT-2 configs of old transformers versions may not say
    family = (None if not isinstance(model_type, str) else hf_llama if model_type in hf_llama.BY_MODEL_TYPE
              else hf_gpt2 if model_type == "gpt2" else hf_moe if model_type in hf_moe.MODEL_TYPES
              else hf_deepseek if model_type == hf_deepseek.MODEL_TYPE
              else hf_gemma3 if model_type == hf_gemma3.MODEL_TYPE
              else hf_gpt_oss if model_type == hf_gpt_oss.MODEL_TYPE else None)
    if family is not None:
        try:
            model = family.model_config_from(hf)
        except (KeyError, TypeError, ValueError) as error:   # a key missing, or a value of the wrong kind
            what = (f"no {error.args[0]!r}" if isinstance(error, KeyError)
                    else f"a value of the wrong type or range ({error})")
            raise CheckpointError(f"{directory / HF_CONFIG}: not a {model_type} config: {what}") from None
    if family is hf_llama:
        canonical = hf_llama.from_hf(read_hf_tensors(directory), model, hf_llama.BY_MODEL_TYPE[model_type])
    elif family is hf_deepseek:
        tensors = read_hf_tensors(directory)
        model = hf_deepseek.stored_model(model, tensors)
        canonical = hf_deepseek.from_hf(tensors, model, hf.get("rope_interleave", True) is not False)
    elif family is not None:
        canonical = family.from_hf(read_hf_tensors(directory), model)
    else:
        raise CheckpointError(f"model_type {model_type!r}: only {hf_gpt2.ARCHITECTURE} (gpt2), "
                              f"{', '.join(f'{a.name} ({a.model_type})' for a in hf_llama.ARCHITECTURES.values())}, "
                              f"{hf_gemma3.ARCHITECTURE} ({hf_gemma3.MODEL_TYPE}), "
                              f"{', '.join(f'{a} ({t})' for t, a in hf_moe.MODEL_TYPES.items())}, "
                              f"{hf_gpt_oss.ARCHITECTURE} ({hf_gpt_oss.MODEL_TYPE}) and "
                              f"{hf_deepseek.ARCHITECTURE} ({hf_deepseek.MODEL_TYPE}) can be imported")
    tokenizer = hf_tokenizer(directory)
    if tokenizer is not None and tokenizer.vocab_size != model.vocab_size:
        if tokenizer.vocab_size > model.vocab_size:
            raise CheckpointError(f"{directory}: the tokenizer has {tokenizer.vocab_size} ids, more than the "
                                  f"model's vocab_size {model.vocab_size}")
        # The model pads its embedding past the tokenizer: keep the rows the tokenizer can produce.
        canonical = {name: t[:tokenizer.vocab_size] if name in _VOCABULARY_ROWS else t for name, t in canonical.items()}
        model = dataclasses.replace(model, vocab_size=tokenizer.vocab_size)
    return save_canonical(save, model, canonical, tokenizer, progress)


def save_canonical(save: str | os.PathLike, model: ModelConfig, canonical: dict[str, torch.Tensor],
                   tokenizer: Optional[Tokenizer], progress: bool) -> Path:
    """A single-process checkpoint at iteration 0 (weights only, fp32) of ``model`` holding the ``canonical``
    tensors (unpadded; every parameter of the model present) and ``tokenizer``; returns it."""
    with single_process_layout():
        with torch.device("meta"):
            gpt = GPTModel(model)
        parameters = []
        named = list(gpt.canonical_named_parameters())
        for name, param in track(named, "converting the tensors", "tensors", enabled=progress):
            # Real tensors cut from the given ones (vocabulary padded as a 1-rank layout pads it) carrying the meta
            # parameter's sharding description, which is all the saver reads.
            tensor = torch.nn.Parameter(split(canonical[name].float(), param.partition, 0, 1), requires_grad=False)
            tensor.full_shape, tensor.partition = param.full_shape, param.partition
            parameters.append((name, tensor))
        return save_checkpoint(save, cfg=MegaliteConfig(model=model), iteration=0, consumed_samples=0,
                               parameters=parameters, tokenizer=tokenizer)


def canonical_shapes(model: ModelConfig) -> dict[str, torch.Size]:
    """The name and full (unpadded) shape of every canonical tensor of ``model``."""
    with single_process_layout():
        with torch.device("meta"):
            gpt = GPTModel(model)
        return {name: torch.Size(param.full_shape) for name, param in gpt.canonical_named_parameters()}


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
