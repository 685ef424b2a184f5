#!/usr/bin/env bash
# The whole test suite: in-process tests, then every distributed test inside ONE torchrun launch of 4 ranks
# (starting torch costs ~3 s per process; one launch amortizes it). Rank 0's report is shown; any rank failing
# fails the launch. Extra arguments go to both pytest runs (e.g. -x, -k name).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q tests --ignore=tests/distributed "$@"
torchrun --nproc_per_node 4 --local-ranks-filter 0 -m pytest -q tests/distributed "$@"
