#!/usr/bin/env bash
# Mutation testing of engine/src with cargo-mutants, one shard at a time, in two stages.
#
#   bench/mutants.sh SHARD [OUT]      e.g. bench/mutants.sh 0/8 target/mutants/shard-0
#   MUTANTS_DONE=FILE bench/mutants.sh SHARD [OUT]   the shard taken up again: stage 1 skips the
#                                    mutants FILE names (one a line, as cargo-mutants lists them)
#   MUTANTS_STAGE2=FILE bench/mutants.sh SHARD [OUT] stage 2 alone, over the mutants FILE names
#                                    (e.g. stage 1's missed list less those killed since)
#   MUTANTS_STAGE1_ONLY=1 bench/mutants.sh SHARD [OUT]  stage 1 alone (with or without
#                                    MUTANTS_DONE); its missed list is a later MUTANTS_STAGE2
#
# Stage 1 tests every mutant of the shard with the engine's own tests (its unit tests and
# engine/tests/it): a mutant there takes about 10 s on a 2-core box. Stage 2 takes the mutants
# stage 1 missed, by name, and tests them with the simulator's unit tests and every test of its
# `tests/it` (the default test campaign `fixed_seeds_have_no_findings`, the pairs' campaign,
# the fault, schedule and command-line tests; about 6 minutes a mutant on a 2-core box beside
# other work on 2026-12-07, a 4-minute build and the tests). Shards 0 and
# 1 (2026-12-04/05) ran a narrower stage 2 (the `tests::` modules and the two campaigns only),
# which left out the fault, schedule, bad-input and command-line tests.
# A mutant is caught when either
# stage's tests fail; both are part of the README's test command.
#
# Both stages build with the `mutants` feature (the zoo's switches), as the README's test command
# does: `cargo test --workspace` unifies the root package's dev-dependency
# `tierkv-sim = { features = ["mutants"] }` into the workspace's one build of the simulator,
# engine and kernels, so the engine's zoo points and their tests
# (`engine/src/mutants/tests.rs`, `engine/tests/it/zoo_points.rs`) run there.
# Runs before commit 79870cf (shards 0-4 and their stage 2s) built without it: their stage 1
# counted as missed the mutants that only a build with the feature can catch. A stage-1 timeout (the
# engine's tests never end) is a catch too and is not tested again.
#
# (cargo-mutants' `--iterate` cannot carry a shard into stage 2: it shards what is left after
# its exclusions, another set of mutants. Hence the list of names.)
#
# cargo-mutants 27.1's `--re` does not filter its "delete field … expression" mutants: a run
# by names (stage 2, MUTANTS_DONE) also tests every such mutant of the files (5 in engine/src
# on 2026-12-07: `cargo mutants -p tierkv-engine --re NOTHING --list` lists them).
#
# Not mutated: engine/src/runtime/cuda.rs and runtime/nccl.rs, which are compiled only with the
# `cuda` / `nccl` features and run only on a GPU (their mutants would build and pass untested on
# a box without one). Sharding is round robin, so each file's mutants are spread over the shards
# (a file with fewer mutants than shards is in some shards only).
#
# Builds use the workspace's `mutants` profile (the dev profile without debug info: an engine
# mutant's stage-1 build took 3.9 s there against 7.4 s in the dev profile, one edit of
# cache.rs measured on 2026-12-07, the tests' time the same). MUTANTS_JOBS=N (default 1) tests N
# mutants at once, each in its own copy of the tree; MUTANTS_TIMEOUT=S (default 120) is the
# stage-1 test timeout in seconds (the engine's tests take about 2 s a mutant there).
#
# Survivors settled by hand at an earlier commit (killed by a later test, or equivalent) carry
# to a later commit's names where the mutated file is unchanged: bench/mutants_carry.py. One
# mutant applied by hand against any command (a new test, a subset of the simulator's tests):
# bench/mutants_hand.py.
#
# Results: OUT/stage1/mutants.out and OUT/stage2/mutants.out (caught.txt, missed.txt,
# timeout.txt, unviable.txt); the missed mutants are stage 2's missed.txt. The record of each
# run is in sim/CAMPAIGNS.md.
set -euo pipefail
shard=${1:?usage: bench/mutants.sh SHARD [OUT], e.g. 0/8}
out=${2:-target/mutants/shard-${shard%/*}}
cd "$(dirname "$0")/.."
mkdir -p "$out/stage1" "$out/stage2" # cargo-mutants makes no parent folders
files=(-p tierkv-engine -e engine/src/runtime/cuda.rs -e engine/src/runtime/nccl.rs)
run=(--profile mutants --jobs "${MUTANTS_JOBS:-1}" --build-timeout 900)
t1=${MUTANTS_TIMEOUT:-120}
# One `--re '^NAME$'` per name on stdin, the name's regex characters escaped, into `re`.
names_re() {
    re=()
    local n
    while IFS= read -r n; do
        re+=(--re "^$(printf '%s' "$n" | sed 's/[][\\.^$*+?(){}|]/\\&/g')\$")
    done
}
# cargo-mutants exits non-zero when a mutant survives; that is a result, not a failure here.
if [ -n "${MUTANTS_STAGE2:-}" ] && [ -n "${MUTANTS_DONE:-}" ]; then
    echo "mutants.sh: MUTANTS_STAGE2 and MUTANTS_DONE together: stage 2 alone takes no stage 1" >&2
    exit 2
fi
if [ -n "${MUTANTS_STAGE2:-}" ] && [ -n "${MUTANTS_STAGE1_ONLY:-}" ]; then
    echo "mutants.sh: MUTANTS_STAGE2 and MUTANTS_STAGE1_ONLY together: nothing would run" >&2
    exit 2
fi
if [ -n "${MUTANTS_STAGE2:-}" ]; then
    [ -f "$MUTANTS_STAGE2" ] || { echo "mutants.sh: MUTANTS_STAGE2=$MUTANTS_STAGE2 is not a file" >&2; exit 2; }
elif [ -n "${MUTANTS_DONE:-}" ]; then
    # A shard taken up again: MUTANTS_DONE names a file of the mutants an earlier stage 1 of
    # this shard already tested (its caught, missed, timeout and unviable lists together);
    # stage 1 tests the rest of the shard by name. Its results hold only those.
    [ -f "$MUTANTS_DONE" ] || { echo "mutants.sh: MUTANTS_DONE=$MUTANTS_DONE is not a file" >&2; exit 2; }
    all=$(cargo mutants "${files[@]}" --shard "$shard" --sharding round-robin --list) ||
        { echo "mutants.sh: cargo mutants --list failed" >&2; exit 2; }
    names_re < <(comm -23 <(printf '%s\n' "$all" | sort -u) <(sort -u "$MUTANTS_DONE"))
    [ ${#re[@]} -gt 0 ] || { echo "mutants.sh: nothing left of shard $shard" >&2; exit 2; }
    cargo mutants "${files[@]}" "${re[@]}" "${run[@]}" -o "$out/stage1" \
        --test-package tierkv-engine --features mutants --timeout "$t1" || true
else
    cargo mutants "${files[@]}" --shard "$shard" --sharding round-robin "${run[@]}" \
        -o "$out/stage1" --test-package tierkv-engine --features mutants --timeout "$t1" || true
fi
# Stage 2 takes stage 1's missed mutants (or MUTANTS_STAGE2's) by name.
re=()
[ -n "${MUTANTS_STAGE1_ONLY:-}" ] || names_re < "${MUTANTS_STAGE2:-$out/stage1/mutants.out/missed.txt}"
if [ ${#re[@]} -gt 0 ]; then
    cargo mutants -p tierkv-engine "${re[@]}" "${run[@]}" -o "$out/stage2" \
        --test-package tierkv-sim --features mutants --timeout 300 \
        -- --lib --test it || true
fi
stages=(stage1 stage2)
[ -z "${MUTANTS_STAGE2:-}" ] || stages=(stage2) # an earlier run's stage 1 is not this run's
for stage in "${stages[@]}"; do
    [ -d "$out/$stage/mutants.out" ] || continue
    printf '%s:' "$stage"
    for f in caught missed timeout unviable; do
        printf ' %s %s' "$f" "$(wc -l < "$out/$stage/mutants.out/$f.txt")"
    done
    echo
done
