"""Pretrain a GPT model: parse the options, check them, build the layout, train.

    torchrun --nproc_per_node 4 pretrain_gpt.py --tensor-model-parallel-size 2 --mock-data model=gpt_tiny

Megatron-style flags and Hydra overrides (key=value, config groups) may be mixed; ``--help`` lists every flag.
"""

from __future__ import annotations

import contextlib
import os
import sys

from megalite.checkpoint.errors import SaveError
from megalite.config.cli import parse_command_line
from megalite.config import ConfigError
from megalite.extensions import ExtensionUnavailable
from megalite.planner.doctor import is_out_of_memory, out_of_memory_message
from megalite.planner.dry_run import format_dry_run
from megalite.planner.preflight import check_machine, no_space_message
from megalite.run import Run
from megalite.training.failures import RollCall, failure_line
from megalite.training import (Trainer, finish_checks, initialize_distributed, rank_device, shutdown_distributed,
                               take_save_lock, world_size_from_env)
from megalite.training.stopping import TrainingError


def error_line(text: str) -> None:
    """One line on stderr in one write, so the lines of ranks that fail together never interleave."""
    try:
        descriptor = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):   # a captured stream (pytest's capsys): no descriptor to write
        print(text, file=sys.stderr, flush=True)
        return
    sys.stderr.flush()
    os.write(descriptor, f"{text}\n".encode())


def main(argv: list[str]) -> int:
    with contextlib.ExitStack() as held:   # the --save directory's lock, released however the run ends
        return _main(argv, held)


def _main(argv: list[str], held: contextlib.ExitStack) -> int:
    try:
        command_line = parse_command_line(argv, world_size_from_env())   # the world size: --deepspeed-config's DP
        simulated = command_line.config.training.simulate_gpus   # --simulate-gpus N: this process plays N GPUs
        if simulated:
            command_line = parse_command_line(argv, simulated)
        world_size = simulated or world_size_from_env()
        # Every rank resolves and checks the run on its own before any collective, so a bad value cannot hang the job.
        run = Run.resolve(command_line.config, world_size, command_line.accepted)
        if not run.cfg.training.dry_run and not simulated:   # more processes than GPUs here: one line, not "invalid
            _, device = rank_device(run.cfg.training.distributed_backend)   # device ordinal"
            # This machine against the run: writable outputs, the memory estimate, one checkpoint on the disk.
            check_machine(run.cfg, world_size, cuda=device.type == "cuda")
        if run.cfg.checkpoint.save and not run.cfg.training.dry_run and not simulated:   # one job per --save
            lock = take_save_lock(run.cfg.checkpoint, 60 * run.cfg.training.distributed_timeout_minutes)
            if lock is not None:
                held.callback(lock.release)
    except ConfigError as error:
        if os.environ.get("RANK", "0") == "0":   # a refused --deepspeed-config: its table shows what was refused
            for line in getattr(error, "table", ()):
                print(line, flush=True)
        error_line(f"megalite: error: {error}")
        finish_checks(failed=True)
        return 2
    finish_checks(failed=False)
    if os.environ.get("RANK", "0") == "0":
        # What a --deepspeed-config file set (and the flags overrode), what the checkpoint's options changed,
        # Megatron's flags that were adjusted or change nothing.
        for line in command_line.deepspeed_settings() + list(run.notes):
            print(line, flush=True)
    cfg = run.cfg
    if simulated:   # rank R's real code path on meta tensors under NCCL's rules (megalite.simulation)
        from megalite.simulation.job import simulate_job
        lines, errors = simulate_job(run)
        for line in lines:
            print(line, flush=True)
        for line in errors:
            error_line(f"megalite: error: simulated {line}")
        return 1 if errors else 0
    if cfg.training.dry_run:   # the planner's memory estimate for this layout; no process group, no training
        if os.environ.get("RANK", "0") == "0":
            print(format_dry_run(cfg, world_size_from_env()), flush=True)
            if cfg.training.plot:   # and as a picture (megalite.visual: matplotlib, never imported by training)
                from megalite.visual.memory import draw_dry_run
                try:
                    print(f"wrote {draw_dry_run(cfg, world_size_from_env())}", flush=True)
                except ConfigError as error:
                    error_line(f"megalite: error: {error}")
                    return 2
        return 0
    device = initialize_distributed(cfg.parallel, timeout_s=60 * cfg.training.distributed_timeout_minutes,
                                    backend=cfg.training.distributed_backend)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart and os.environ.get("RANK", "0") == "0":   # torchrun --max-restarts began this attempt after a failure
        print(f"megalite: torchrun restart {restart} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}", flush=True)
    roll_call = RollCall.join()   # answers, from a thread, a rank that fails and asks who is still here
    try:
        trainer = Trainer(run, device)
        description = trainer.describe()   # collective: every rank computes it, rank 0 prints it
        trainer.logger.print(description)
        trainer.train()
        shutdown_distributed(wait_for_peers=True)
    except ConfigError as error:   # a checkpoint that does not fit the model: every rank finds it alike
        error_line(f"megalite: error: {error}")
        return 2
    except TrainingError as error:   # a NaN/Inf loss or gradient: the iteration and the ranks, in one line
        error_line(f"megalite: error: {error}")
        return 1
    except ExtensionUnavailable as error:   # --use-fused-kernels on, and the kernels do not build or pass here
        error_line(f"megalite: error: rank {os.environ.get('RANK', '0')}: {error}")
        return 1
    except SaveError as error:   # a full or read-only disk at a save: every rank finds it (save.py, storage.py)
        line = no_space_message(cfg, error, error.directory) or str(error)
        error_line(f"megalite: error: rank {os.environ.get('RANK', '0')}: {line}")
        return 1
    except (RuntimeError, MemoryError) as error:   # torch's DistBackendError and OutOfMemoryError are RuntimeErrors
        if is_out_of_memory(error):   # which memory ran over, by how much, and what to change
            error_line(out_of_memory_message(cfg, error))
            return 1
        # A dead or stalled peer: one line (which collective, which ranks are gone) instead of a backend traceback.
        line = failure_line(error, int(os.environ.get("RANK", "0")), cfg.training.distributed_timeout_minutes,
                            roll_call)
        if line is None:
            raise
        error_line(line)
        return 1
    finally:
        shutdown_distributed()
        if roll_call is not None:
            roll_call.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
