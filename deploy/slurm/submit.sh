#!/bin/bash
# Submits the campaign's job array, then its merge to run once every task has ended:
#   TIERKV_BIN=/path/to/tierkv TIERKV_RESULTS=/shared/tierkv-results deploy/slurm/submit.sh
# Every node must see the same binary (built once: cargo build --release -p tierkv-sim) and the
# same results folder.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
array=$(sbatch --parsable --export=ALL "$here/campaign.sbatch")
merge=$(sbatch --parsable --export=ALL --dependency="afterany:${array%%;*}" "$here/merge.sbatch")
echo "campaign: job array $array; merge: job $merge"
