"""Pretrain a GPT model: parse the options, check them, build the layout, train.

    torchrun --nproc_per_node 4 pretrain_gpt.py --tensor-model-parallel-size 2 --mock-data model=gpt_tiny

Megatron-style flags and Hydra overrides (key=value, config groups) may be mixed; ``--help`` lists every flag.
"""

from __future__ import annotations

import sys

from megalite.cli import parse_args
from megalite.config import ConfigError, validate
from megalite.data import check_data_files
from megalite.training import Trainer, initialize_distributed, shutdown_distributed, world_size_from_env


def main(argv: list[str]) -> int:
    try:
        cfg = parse_args(argv)
        # Every rank checks the options on its own before any collective, so a bad value cannot hang the job.
        validate(cfg, world_size_from_env())
        check_data_files(cfg)   # data files too: a corrupt file stops every rank here, not in a collective
    except ConfigError as error:
        print(f"megalite: error: {error}", file=sys.stderr, flush=True)
        return 2
    device = initialize_distributed(cfg.parallel)
    try:
        trainer = Trainer(cfg, device)
        description = trainer.describe()   # collective: every rank computes it, rank 0 prints it
        trainer.logger.print(description)
        trainer.train()
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
