#!/usr/bin/env bash
# Mutation testing of engine/src with cargo-mutants, one shard at a time, in two stages.
#
#   bench/mutants.sh SHARD [OUT]      e.g. bench/mutants.sh 0/8 /tmp/mutants/shard0
#
# Stage 1 tests every mutant of the shard with the engine's own tests (its unit tests and
# engine/tests/it): a mutant build there takes about 10 s on a 2-core box. Stage 2 takes only the
# mutants stage 1 missed (cargo-mutants' `--iterate`) and tests them with the simulator's default
# test campaign (`fixed_seeds_have_no_findings`: 24 swarm seeds, and every coverage probe hit) and
# the prefill/decode pairs' campaign (`pd_pairs_have_no_findings`). A mutant is caught when either
# stage's tests fail; both stages are part of the README's test command.
#
# Not mutated: engine/src/runtime/cuda.rs and runtime/nccl.rs, which are compiled only with the
# `cuda` / `nccl` features and run only on a GPU (their mutants would build and pass untested on
# a box without one). Sharding is round robin, so each shard samples every file.
#
# The results are in OUT/mutants.out (caught.txt, missed.txt, timeout.txt, unviable.txt); the
# record of each run is in sim/CAMPAIGNS.md.
set -euo pipefail
shard=${1:?usage: bench/mutants.sh SHARD [OUT], e.g. 0/8}
out=${2:-target/mutants/shard-${shard%/*}}
cd "$(dirname "$0")/.."
common=(-p tierkv-engine -e engine/src/runtime/cuda.rs -e engine/src/runtime/nccl.rs
    --shard "$shard" --sharding round-robin --build-timeout 900 -o "$out")
# cargo-mutants exits non-zero when a mutant survives; that is a result, not a failure here.
cargo mutants "${common[@]}" --test-package tierkv-engine --timeout 120 || true
cargo mutants "${common[@]}" --iterate --test-package tierkv-sim --timeout 300 \
    -- --test it -- fixed_seeds_have_no_findings pd_pairs_have_no_findings || true
for f in caught missed timeout unviable; do
    printf '%-9s %s\n' "$f" "$(wc -l < "$out/mutants.out/$f.txt")"
done
