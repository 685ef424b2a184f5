"""The manifest: a checkpoint's table of contents, in JSON (``manifest.json`` beside DCP's files).

It holds everything that is not a tensor: the iteration and consumed samples, the layout the checkpoint was saved at,
the full config it was trained with, the loss-scaler state and Adam's step count, the tokenizer (its type, files
and fingerprint), and for every parameter (by canonical name) its full shape, how it was partitioned over
tensor-parallel ranks, and its dtype. The tensors themselves are in DCP's files under the keys of
:mod:`megalite.checkpoint.keys`; the manifest is what lets a loader at another layout find and merge them. JSON, not
pickle, so reading a manifest cannot run code.

It also holds the digests of everything else in the checkpoint (:class:`Digests`) and, last, ``manifest_digest``:
the digest of the manifest's own JSON without that line, checked on every read. Reading refuses keys it does not
know, so a flipped byte cannot turn a key into one that is silently ignored. A manifest without digests was written
before megalite recorded them; it still loads, and the loader says that nothing was verified.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megalite.checkpoint.digests import digest_bytes
from megalite.checkpoint.errors import CheckpointError
from megalite.config import MegaliteConfig, OptimizerConfig, from_dict
from megalite.config.megatron import SAVED_BEFORE
from megalite.tensor_parallel import Partition, shard

MANIFEST_NAME = "manifest.json"
FORMAT = "megalite-checkpoint"
VERSION = 1


@dataclass(frozen=True)
class SavedLayout:
    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    dp: int = 1
    zero: int = 0      # OptimizerConfig.zero_level
    cp: int = 1        # context-parallel size (manifests from before it was saved: 1)
    pipeline_schedule: str = "1f1b"   # which layers a rank holds (zbv: the v-shape) and in which order it runs them
    ep: int = 1        # expert-parallel size (experts are stored by global name: any EP loads them)

    @classmethod
    def of(cls, cfg: MegaliteConfig, dp: int) -> "SavedLayout":
        """The layout ``cfg`` runs at this data-parallel size."""
        p = cfg.parallel
        return cls(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                   p.virtual_stages(cfg.model.num_layers), dp, cfg.optimizer.zero_level, p.context_parallel_size,
                   p.pipeline_schedule if p.pipeline_model_parallel_size > 1 else "1f1b",
                   p.expert_model_parallel_size)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SavedLayout":
        data = dict(data)
        if "zero_stage" in data:   # written before the ZeRO level was one field
            data["zero"] = OptimizerConfig(use_distributed_optimizer=data.pop("distributed_optimizer"),
                                           zero_stage=data.pop("zero_stage")).zero_level
        return cls(**data)

    def describe(self) -> str:
        text = f"TP={self.tp} x PP={self.pp}"
        if self.virtual_stages > 1:
            text += f" (V={self.virtual_stages})"
        if self.cp > 1:
            text += f" x CP={self.cp}"
        if self.pipeline_schedule != "1f1b":
            text += f" {self.pipeline_schedule}"
        text += f" x DP={self.dp}" + (f" (EP={self.ep})" if self.ep > 1 else "")
        if self.zero == 3:
            text += ", fully sharded (ZeRO-3)"
        elif self.zero:
            text += f", distributed optimizer (ZeRO-{self.zero})"
        return text

    def ranks(self) -> list[tuple[int, int, int]]:
        """Every rank of the layout as (pp rank, tp rank, rank in DP x CP)."""
        return [(p, t, d) for p in range(self.pp) for d in range(self.dp * self.cp) for t in range(self.tp)]


@dataclass(frozen=True)
class TensorSpec:
    """How one parameter was stored: ``slices`` pieces (1 when replicated over TP) cut from the full tensor."""
    full_shape: tuple[int, ...]
    partition: Partition
    slices: int
    dtype: str
    optimized: bool = True   # the checkpoint holds its optimizer states (if it holds any); False for an expert bias

    def slice_shapes(self) -> list[tuple[int, ...]]:
        """Shape of each stored slice (computed on the meta device, so it follows ``shard`` exactly)."""
        full = torch.empty(self.full_shape, device="meta")
        return [tuple(shard(full, self.partition, rank, self.slices).shape) for rank in range(self.slices)]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def to_json(self) -> dict:
        data = {"full_shape": list(self.full_shape), "partition": dataclasses.asdict(self.partition),
                "slices": self.slices, "dtype": self.dtype}
        return data if self.optimized else {**data, "optimized": False}

    @classmethod
    def from_json(cls, data: dict) -> "TensorSpec":
        # JSON has no tuples: a tuple of fused block sizes comes back as a list.
        partition = {k: tuple(v) if isinstance(v, list) else v for k, v in data["partition"].items()}
        dtype = data["dtype"]
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        return cls(tuple(int(x) for x in data["full_shape"]), Partition(**partition), int(data["slices"]), dtype,
                   bool(data.get("optimized", True)))


@dataclass
class Digests:
    """What a save hashed (see :mod:`megalite.checkpoint.digests`), each a hex digest of the bytes on disk."""
    algorithm: str
    index: str                                # DCP's .metadata
    items: dict[str, str]                     # tensor key -> its bytes in a .distcp file
    files: dict[str, str] = dataclasses.field(default_factory=dict)   # tokenizer file name -> its bytes

    @classmethod
    def from_json(cls, data: dict) -> "Digests":
        return cls(str(data["algorithm"]), str(data["index"]), {str(k): str(v) for k, v in data["items"].items()},
                   {str(k): str(v) for k, v in data["files"].items()})


_KEYS = {"format", "version", "iteration", "consumed_samples", "layout", "adam_step", "loss_scaler", "rng_streams",
         "tokenizer", "config", "params", "digests", "manifest_digest"}


@dataclass
class Manifest:
    iteration: int
    consumed_samples: int
    layout: SavedLayout
    config: dict                              # MegaliteConfig as nested dicts (section -> field -> value)
    params: dict[str, TensorSpec]             # canonical name -> how it is stored
    adam_step: Optional[int] = None           # None: no optimizer state in the checkpoint
    loss_scaler: Optional[dict] = None        # fp16 loss-scaler state
    rng_streams: list[str] = dataclasses.field(default_factory=list)   # stored per rank; empty: no RNG state
    # {"type", "vocab_size", "eod", "fingerprint", "files": [names in the checkpoint dir], "file": the one file}
    tokenizer: Optional[dict] = None
    digests: Optional[Digests] = None         # None: saved before megalite recorded digests

    @property
    def has_optimizer(self) -> bool:
        return self.adam_step is not None

    def to_json(self) -> str:
        data = {"format": FORMAT, "version": VERSION, "iteration": self.iteration,
                "consumed_samples": self.consumed_samples, "layout": dataclasses.asdict(self.layout),
                "adam_step": self.adam_step, "loss_scaler": self.loss_scaler, "rng_streams": self.rng_streams,
                "tokenizer": self.tokenizer, "config": self.config,
                "params": {name: spec.to_json() for name, spec in self.params.items()}}
        if self.digests is not None:
            data["digests"] = dataclasses.asdict(self.digests)
            data["manifest_digest"] = _self_digest(data, self.digests.algorithm)
        return json.dumps(data, indent=1)

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        """The manifest of a checkpoint directory; any problem is a one-line CheckpointError naming the file."""
        path = directory / MANIFEST_NAME
        if not path.is_file():
            raise CheckpointError(f"{directory}: not a complete checkpoint: {MANIFEST_NAME} is missing")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{path}: unreadable ({error})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a megalite checkpoint manifest")
        if data.get("version") != VERSION:
            raise CheckpointError(f"{path}: format version {data.get('version')} (this megalite reads {VERSION})")
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            raise CheckpointError(f"{path}: malformed manifest (unknown key {unknown[0]!r})")
        claimed = data.pop("manifest_digest", None)
        if (claimed is None) != ("digests" not in data):
            raise CheckpointError(f"{path}: malformed manifest (digests without manifest_digest, or the reverse)")
        try:
            digests = Digests.from_json(data["digests"]) if claimed is not None else None
        except (KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{path}: malformed manifest digests ({type(error).__name__}: {error})") from None
        if digests is not None:
            try:
                actual = _self_digest(data, digests.algorithm)
            except CheckpointError as error:   # an unknown algorithm, or xxhash not installed
                raise CheckpointError(f"{path}: {error}") from None
            if actual != claimed:
                raise CheckpointError(f"{path}: checksum mismatch (the manifest changed since it was saved)")
        try:
            return cls(iteration=int(data["iteration"]), consumed_samples=int(data["consumed_samples"]),
                       layout=SavedLayout.from_json(data["layout"]), config=dict(data["config"]),
                       params={name: TensorSpec.from_json(spec) for name, spec in data["params"].items()},
                       adam_step=None if data["adam_step"] is None else int(data["adam_step"]),
                       loss_scaler=data["loss_scaler"], rng_streams=list(data["rng_streams"]),
                       tokenizer=data["tokenizer"], digests=digests)
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{path}: malformed manifest ({type(error).__name__}: {error})") from None

    def megalite_config(self) -> MegaliteConfig:
        """The config the checkpoint was trained with, as this version of megalite reads it (options it does not
        know are dropped with a warning; options the checkpoint predates get their defaults)."""
        return config_from_dict(self.config)


def _self_digest(data: dict, algorithm: str) -> str:
    """The digest of the manifest's JSON as written, without its ``manifest_digest`` (JSON read back and written
    again gives the same text, so the reader recomputes it from the parsed data)."""
    return digest_bytes(json.dumps({k: v for k, v in data.items() if k != "manifest_digest"}, indent=1).encode(),
                        algorithm)


def config_from_dict(data: dict[str, Any]) -> MegaliteConfig:
    """The saved config; options this megalite does not know are left out with a warning (Megatron's flags that
    were options before they were accepted without effect, quietly)."""
    cfg, unknown = from_dict(data)
    unknown = [key for key in unknown if key not in SAVED_BEFORE]
    if unknown:
        warnings.warn(f"checkpoint config options unknown to this megalite are ignored: {', '.join(unknown)}",
                      stacklevel=2)
    return cfg


__all__ = ["MANIFEST_NAME", "Digests", "Manifest", "SavedLayout", "TensorSpec", "config_from_dict"]
