"""Checking a whole checkpoint offline (``tools/convert_checkpoint.py verify``), without building a model.

Everything a load could need is there (the structural check of :meth:`Checkpoint.verify`, with optimizer and RNG
states), and every stored byte matches the digests of the save: the manifest, DCP's index, each tensor item, each
tokenizer file. The first problem is raised as a one-line CheckpointError naming the file and the item. On a
terminal a bar counts the tensors checked.
"""

from __future__ import annotations

import os

from megalite.checkpoint.contents import NO_DIGESTS, open_checkpoint
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.storage import METADATA_NAME
from megalite.progress import Progress

_TENSORS_PER_READ = 64   # tensors checked between two updates of the bar


def verify_checkpoint(load: str | os.PathLike, progress: bool = True, allow_unverified: bool = False) -> str:
    """Verify the checkpoint ``load`` names (a checkpoint directory, or a --save directory: its latest); returns a
    one-line summary of what was checked, or raises CheckpointError. A checkpoint without digests fails (nothing
    says its bytes are the ones saved) unless ``allow_unverified``: then only its completeness is checked.
    ``progress``: the bar (where it can show)."""
    checkpoint = open_checkpoint(load)   # the manifest's digest, then the index's
    manifest = checkpoint.manifest
    checkpoint.verify(optimizer=manifest.has_optimizer, rng=bool(manifest.rng_streams))
    keys = checkpoint.in_storage_order(checkpoint.metadata.state_dict_metadata)
    stored = sum(checkpoint.item_sizes(keys))
    data_files = len({info.relative_path for info in checkpoint.metadata.storage_data.values()})
    what = f"{len(keys)} tensors ({stored / 2**20:.1f} MiB) in {data_files} data file(s)"
    if not checkpoint.has_digests:
        if not allow_unverified:
            raise CheckpointError(f"{checkpoint.path}: {NO_DIGESTS} (--allow-unverified accepts it once complete)")
        return f"{checkpoint.path}: complete, {what}; but {NO_DIGESTS}"
    digests = manifest.digests
    extra = sorted(set(digests.items) - set(keys))
    if extra:
        raise CheckpointError(f"{checkpoint.path / METADATA_NAME}: the manifest has a digest of {extra[0]}, which "
                              f"DCP's index does not list")
    with Progress(len(keys), "verifying the tensors", "tensors", enabled=progress) as bar:
        for start in range(0, len(keys), _TENSORS_PER_READ):
            checkpoint.verify_contents(keys[start:start + _TENSORS_PER_READ])
            bar.update(len(keys[start:start + _TENSORS_PER_READ]))
    tokenizer_files = (manifest.tokenizer or {}).get("files", [])
    checkpoint.verify_files(tokenizer_files)
    extras = "".join(f", {name}" for name in tokenizer_files)
    return (f"{checkpoint.path}: OK: {what}, the manifest, DCP's index{extras} match their {digests.algorithm} "
            f"digests")
