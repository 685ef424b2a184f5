"""Datasets and samplers: what the model reads, in a layout-independent order.

``build_datasets(cfg, (train, valid, test) sample counts)`` is the entry point: mock data, ``--data-path`` prefixes
(blended by weight) or the built-in corpus; ``check_data_files(cfg)`` validates the files on every rank before any
collective. Tokenizers, the indexed file format, the preprocessor and the index builders are in the modules below.
"""

from megalite.data.builder import DataBundle, build_datasets, check_data_files, run_tokenizer
from megalite.data.errors import DataError
from megalite.data.mock import MockGPTDataset
from megalite.data.sampler import micro_batch_indices

__all__ = ["DataBundle", "DataError", "MockGPTDataset", "build_datasets", "check_data_files", "micro_batch_indices",
           "run_tokenizer"]
