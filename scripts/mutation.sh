#!/usr/bin/env bash
# Mutation testing of one core module with mutmut (docs/testing.md); not run in CI.
#
#   scripts/mutation.sh MODULE        # MODULE: a [tool.stp-mutation.*] name in pyproject.toml
#   MUTMUT_CHILDREN=1 scripts/mutation.sh sim
#   scripts/mutation.sh lr 'stp.train.step.lr.x_adamw*'   # re-test only these mutants
#
# Runs in .mutation/MODULE/ (mutmut keeps its state in mutants/ there, so a
# second run only re-tests mutants of changed functions), prints the survivors
# and the score. Inspect one: cd .mutation/MODULE && python -m mutmut show NAME
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: scripts/mutation.sh MODULE [MUTANT_NAME_OR_GLOB...] (MODULE: one of the" \
        "[tool.stp-mutation.*] names in pyproject.toml)" >&2
    exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
module="$1"
shift
stage="$(python "$root/scripts/mutation_stage.py" stage "$root" "$module")"
cd "$stage"
# spawned workers and subprocesses import the mutated copy, not the checkout or an
# editable install. The folder must exist before Python starts: a sys.path entry
# that is missing then is cached as "nothing here" and never looked at again.
mkdir -p "$stage/mutants/src"
export PYTHONPATH="$stage/mutants/src"
# one intra-op thread per test process on a small machine
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
start=$SECONDS
nice -n 10 python -m mutmut run --max-children "${MUTMUT_CHILDREN:-2}" "$@"
echo "mutation run of $module took $((SECONDS - start)) s"
echo "survivors of $module (python -m mutmut show NAME in $stage for the diff):"
python -m mutmut results | grep -v ': killed$\|: not checked$' || true
python -m mutmut export-cicd-stats >/dev/null
echo "$module: $(python "$root/scripts/mutation_stage.py" score mutants/mutmut-cicd-stats.json)"
