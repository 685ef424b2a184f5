#!/usr/bin/env bash
# The whole test suite: in-process tests, then the distributed tests inside one torchrun launch of 4 ranks and one
# of 8 (for the TP x PP x DP layout); starting torch costs ~3 s per process, so each launch runs many tests. Rank 0's
# report is shown; the ranks agree on every test's outcome, so a failure on any rank shows there and fails the launch
# (tests/multiprocess/lockstep.py). Every stage runs even when an earlier one failed; the exit status is non-zero if
# any did, and the last line names them. Extra arguments go to every pytest run (e.g. -x, -k name).
set -uo pipefail
cd "$(dirname "$0")/.."
failed=()

stage() {   # stage NAME COMMAND...
    local name=$1; shift
    echo "=== ${name}: $*"
    "$@" || failed+=("${name}")
}

stage "in-process" python -m pytest -q tests --ignore=tests/multiprocess "$@"
stage "torchrun 4 ranks" torchrun --standalone --nproc_per_node 4 --local-ranks-filter 0 -m pytest -q tests/multiprocess "$@"
stage "torchrun 8 ranks" torchrun --standalone --nproc_per_node 8 --local-ranks-filter 0 -m pytest -q tests/multiprocess "$@"

if ((${#failed[@]})); then
    echo "tests/run.sh: FAILED stage(s): $(IFS=,; echo "${failed[*]}" | sed 's/,/, /g')"
    exit 1
fi
echo "tests/run.sh: all stages passed"
