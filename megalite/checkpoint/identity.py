"""Same model or a clear refusal: a resumed run must compute what the checkpoint's weights were trained to compute.

The model options whose role is ``model`` count (:data:`megalite.config.schema.MODEL_DEFINING`; an option added
later counts by default), not those that only say how it trains or how its numbers are computed: dropout,
initialization, the sequence length, activation recompute, FP8, the MoE balancing losses, token dropping, grouped
GEMM, the token dispatcher and the vocabulary's padding multiple (padded rows are masked out). Options
compare by the value they resolve to: an unset ``--ffn-hidden-size`` is 4 x hidden, grouped-query attention with as
many groups as heads is plain attention, ``--rotary-base`` counts only with rotary positions and
``--max-position-embeddings`` only with a learned position table.
The tokenizer compares by :meth:`Tokenizer.fingerprint` (type, vocabulary, EOD and the bytes of its files), which
the manifest records (a checkpoint from before that has its tokenizer rebuilt from the stored file); when the
checkpoint has no tokenizer (mock data, imported weights) or the run has none, there is nothing to compare.

A difference stops every rank with one line listing each one with both values. ``--use-checkpoint-args`` (Megatron's
flag) takes every model option from the checkpoint instead, and, when the data comes from ``--data-path``, its
tokenizer too (rebuilt from the files stored beside the weights); ``--finetune`` loads the weights into this run's
model anyway (their shapes must fit) and notes what differs. Layout and optimizer options may differ: resharding is
the point.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megalite.checkpoint.contents import Checkpoint, open_load_checkpoint
from megalite.checkpoint.errors import CheckpointError
from megalite.config import MegaliteConfig, ModelConfig
from megalite.config.flags import FLAG
from megalite.config.schema import MODEL_DEFINING
from megalite.data.errors import DataError
from megalite.checkpoint.tokenizer import saved_tokenizer
from megalite.data.tokenizer import Tokenizer, tokenizer_options_for


def model_identity(model: ModelConfig) -> dict[str, object]:
    """Option name -> the value it resolves to, for every option that decides what the model computes."""
    identity = {name: getattr(model, name) for name in MODEL_DEFINING}
    identity.update(ffn_hidden_size=model.ffn_size, num_query_groups=model.query_groups)
    del identity["group_query_attention"]   # folded into num_query_groups
    if model.position_embedding_type == "rope":
        del identity["max_position_embeddings"]
    else:
        identity["max_position_embeddings"] = model.max_positions
        del identity["rotary_base"]
    return identity


def _saved_tokenizer_files(checkpoint: Checkpoint) -> list[str]:
    """The names of the tokenizer's files stored in the checkpoint, checked against their digests."""
    info = checkpoint.manifest.tokenizer
    files = list(info.get("files", [info["file"]] if "file" in info else []))
    checkpoint.verify_files(files)
    return files


def _saved_fingerprint(checkpoint: Checkpoint) -> Optional[str]:
    """The recorded fingerprint, or (a checkpoint from before they were recorded) that of the rebuilt tokenizer."""
    info = checkpoint.manifest.tokenizer
    if "fingerprint" in info:
        return info["fingerprint"]
    _saved_tokenizer_files(checkpoint)
    try:
        return saved_tokenizer(checkpoint).fingerprint()
    except DataError:
        return None


def differences(checkpoint: Checkpoint, model: ModelConfig, tokenizer: Optional[Tokenizer]) -> list[str]:
    """Each way this run's model (and tokenizer) differs from the checkpoint's, with both values."""
    saved, mine = model_identity(checkpoint.manifest.megalite_config().model), model_identity(model)
    found = [f"{getattr(FLAG, name)} {saved[name]} (checkpoint) vs {value}" for name, value in mine.items()
             if name in saved and saved[name] != value]
    if checkpoint.manifest.tokenizer is not None and tokenizer is not None:
        fingerprint, ours = _saved_fingerprint(checkpoint), tokenizer.fingerprint()
        if fingerprint is not None and fingerprint != ours:
            found.append(f"tokenizer {checkpoint.manifest.tokenizer['type']} {fingerprint[:12]} (checkpoint) vs "
                         f"{type(tokenizer).__name__} {ours[:12]}")
    return found


def check_same_model(checkpoint: Checkpoint, model: ModelConfig, tokenizer: Optional[Tokenizer],
                     finetune: bool) -> list[str]:
    """Raise CheckpointError listing every difference (see the module docstring); with ``finetune``, return a note
    of them instead."""
    found = differences(checkpoint, model, tokenizer)
    if not found:
        return []
    if finetune:
        return [f"{FLAG.finetune}: this model differs from the checkpoint's: {', '.join(found)}"]
    raise CheckpointError(f"{checkpoint.path}: trained with another model: {', '.join(found)} "
                          f"({FLAG.use_checkpoint_args} takes the model from the checkpoint, {FLAG.finetune} loads its "
                          f"weights into this one)")


def use_checkpoint_args(cfg: MegaliteConfig) -> tuple[MegaliteConfig, list[str]]:
    """With ``--use-checkpoint-args``: ``cfg`` with every model option taken from the ``--load`` checkpoint (and,
    with ``--data-path``, its tokenizer), and a note of what that changed. No checkpoint yet (``--load`` equal to
    ``--save``, first run): ``cfg`` as given. Reads the manifest only; no process group needed."""
    c = cfg.checkpoint
    if not c.use_checkpoint_args or c.load is None:
        return cfg, []
    checkpoint = open_load_checkpoint(c)
    if checkpoint is None:
        return cfg, [f"{FLAG.use_checkpoint_args}: no checkpoint yet, the model options of the command line"]
    saved = checkpoint.manifest.megalite_config().model
    taken = {name: getattr(saved, name) for name in MODEL_DEFINING}
    changed = [f"{getattr(FLAG, name)} {value}" for name, value in taken.items() if getattr(cfg.model, name) != value]
    data = cfg.data
    if checkpoint.manifest.tokenizer is not None and data.data_path is not None and not data.mock_data:
        _saved_tokenizer_files(checkpoint)
        options = tokenizer_options_for(checkpoint.manifest.tokenizer["type"], checkpoint.path)
        if any(getattr(data, name) != value for name, value in options.items()):
            data = dataclasses.replace(data, **options)
            changed.append(" ".join(f"{getattr(FLAG, name)} {value}" for name, value in options.items()
                                    if value is not None and name in ("tokenizer_type", "tokenizer_model",
                                                                      "vocab_file", "merge_file")))
    note = (f"{FLAG.use_checkpoint_args}: the model options of {checkpoint.path}" +
            (f" ({', '.join(changed)})" if changed else " (the same as the command line's)"))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **taken), data=data), [note]
