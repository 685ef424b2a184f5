#!/usr/bin/env bash
# The whole test suite: in-process tests, then the distributed tests inside one torchrun launch of 4 ranks and one
# of 8 (for the TP x PP x DP layout); starting torch costs ~3 s per process, so each launch runs many tests. Rank 0's
# report is shown; any rank failing fails the launch. Extra arguments go to every pytest run (e.g. -x, -k name).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q tests --ignore=tests/multiprocess "$@"
torchrun --nproc_per_node 4 --local-ranks-filter 0 -m pytest -q tests/multiprocess "$@"
torchrun --nproc_per_node 8 --local-ranks-filter 0 -m pytest -q tests/multiprocess "$@"
