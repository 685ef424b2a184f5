"""Checkpoints: each rank saves its own shards through torch.distributed.checkpoint, atomically; loading reshards to
any layout; conversion to and from Hugging Face GPT-2, Llama, Mistral and Qwen2 (tokenizers included);
``load_pretrained`` for single-process use.

``save_checkpoint`` / ``load_checkpoint`` are what the trainer calls, ``check_checkpoint`` the pre-flight check that
``pretrain_gpt.py`` runs before any process group exists. The layout on disk is described in ``directory``, the
tensor names in ``keys``, the JSON table of contents in ``manifest``.
"""

from megalite.checkpoint.contents import Checkpoint, open_checkpoint
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.load import LoadResult, check_checkpoint, load_checkpoint
from megalite.checkpoint.manifest import Manifest, SavedLayout, TensorSpec
from megalite.checkpoint.pretrained import PretrainedGPT, load_pretrained
from megalite.checkpoint.save import save_checkpoint
from megalite.checkpoint.tokenizer import saved_tokenizer, with_checkpoint_tokenizer

__all__ = ["Checkpoint", "CheckpointError", "LoadResult", "Manifest", "PretrainedGPT", "SavedLayout", "TensorSpec",
           "check_checkpoint", "load_checkpoint", "load_pretrained", "open_checkpoint", "save_checkpoint",
           "saved_tokenizer", "with_checkpoint_tokenizer"]
