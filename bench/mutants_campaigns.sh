#!/usr/bin/env bash
# Stage 2 by the default test campaigns alone, one mutant at a time, for survivors of stage 1.
#
#   TREE=/path/to/worktree bench/mutants_campaigns.sh NAMES OUT
#
# NAMES holds mutant names, one a line, as `cargo mutants --list` writes them. Each is applied
# by hand in TREE (bench/mutants_hand.py; TREE is a checkout whose engine/src is the commit the
# names were listed at, and not the tree you work in: the source is mutated while it runs). The
# `tierkv` binary is built as the README's test command builds the simulator (the dev profile,
# the `mutants` feature) and runs the two default campaigns of sim/tests/it/main.rs:
# `sim --seeds 0..25` (the swarm seeds of `fixed_seeds_have_no_findings`) and, when those pass,
# `sim --profile pd --seeds 0..6` (`pd_pairs_have_no_findings`). A campaign with a finding exits
# non-zero, and then that test fails too: the mutant is caught by the test suite. A mutant that
# passes both is NOT shown to survive the suite: those tests also assert coverage and totals, and
# the simulator has other tests (faults, loads, offload, regressions); it goes to a full stage 2
# (MUTANTS_STAGE2 in bench/mutants.sh) or to a hand test.
#
# Each campaign is stopped after 900 s: a mutant that hangs the engine is caught (its test would
# never end; cargo-mutants counts a timeout as caught too).
#
# Appends `NAME<TAB>killed|passed<TAB>which campaign, first finding` to OUT/results.tsv and keeps
# each mutant's output in OUT/logs/. Names already in results.tsv are skipped, so a stopped run
# is taken up by running it again. "delete match arm" and "delete field" mutants are skipped
# (listed as `skipped`): apply them by hand.
set -uo pipefail
names=${1:?usage: TREE=DIR bench/mutants_campaigns.sh NAMES OUT}
out=${2:?usage: TREE=DIR bench/mutants_campaigns.sh NAMES OUT}
tree=${TREE:?TREE: the worktree to mutate (not the one you work in)}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)
touch "$out/results.tsv"
# The command run in TREE with a mutant applied: build, then the swarm, then the pairs.
cmd='cargo build -q -p tierkv-sim --features mutants --bin tierkv || exit 3
     echo "=== campaign swarm 0..25"
     timeout 900 target/debug/tierkv sim --seeds 0..25 --jobs 2 --no-shrink --out-dir target/mutants-campaigns || exit 1
     echo "=== campaign pd 0..6"
     timeout 900 target/debug/tierkv sim --profile pd --seeds 0..6 --jobs 2 --no-shrink --out-dir target/mutants-campaigns || exit 1'
# MUTANTS_ZOO="ZOO-MUTANT PROFILE" instead: for code that only a zoo mutant runs (compiled out
# of the product), the zoo test's row of that mutant (tests/it/zoo.rs: caught within 100 seeds
# of PROFILE, `pd` for the pairs' mutants, else `swarm`). The product mutant is killed when the
# zoo mutant is NOT caught there (that test fails), and passes when it still is; the unmutated
# tree must catch it.
if [ -n "${MUTANTS_ZOO:-}" ]; then
    read -r zoo_mutant zoo_profile <<<"$MUTANTS_ZOO"
    cmd="cargo build -q -p tierkv-sim --features mutants --bin tierkv-zoo || exit 3
         echo '=== campaign zoo-$zoo_mutant 0..100'
         timeout 900 target/debug/tierkv-zoo sim --mutant $zoo_mutant --profile $zoo_profile \\
             --seeds 0..100 --jobs 2 --no-shrink --out-dir target/mutants-campaigns
         case \$? in
             0) echo 'finding: zoo mutant $zoo_mutant not caught within 100 seeds'; exit 1 ;;
             124) echo 'finding: timeout (900 s)'; exit 1 ;;
         esac"
fi
passed_what="both campaigns"
[ -n "${MUTANTS_ZOO:-}" ] && passed_what="the zoo mutant caught"
# The unmutated tree first: both campaigns must pass there, or no result below means anything.
if ! grep -q '^(unmutated)' "$out/results.tsv"; then
    if ! (cd "$tree" && bash -c "$cmd") >"$out/logs/unmutated.log" 2>&1; then
        echo "mutants_campaigns.sh: the unmutated tree fails; see $out/logs/unmutated.log" >&2
        exit 1
    fi
    printf '(unmutated)\tpassed\t%s\n' "$passed_what" >>"$out/results.tsv"
fi
i=0
while IFS= read -r name; do
    [ -z "$name" ] && continue
    i=$((i + 1))
    if cut -f1 "$out/results.tsv" | grep -qxF -- "$name"; then
        continue
    fi
    log="$out/logs/$i.log"
    if [[ "$name" == *"match arm"* || "$name" == *"delete field"* ]]; then
        printf '%s\tskipped\tapply by hand\n' "$name" >>"$out/results.tsv"
        continue
    fi
    start=$(date +%s)
    # mutants_hand.py keeps the command's output to itself: the command writes it to the log.
    ROOT="$tree" python3 "$here/mutants_hand.py" "$name" -- \
        bash -c "cd '$tree' && { $cmd; } >'$log.out' 2>&1" >"$log" 2>&1
    rc=$?
    cat "$log.out" >>"$log" 2>/dev/null && rm -f "$log.out"
    secs=$(($(date +%s) - start))
    if grep -q '^KILLED ' "$log"; then
        which=$(grep -o '^=== campaign [a-z-]* [0-9.]*' "$log" | tail -1 | sed 's/^=== campaign //')
        first=$(grep -m1 'finding:' "$log" | sed 's/^ *finding: //' | cut -c1-160)
        if grep -q 'could not compile' "$log"; then
            printf '%s\tunviable\tdoes not build (%ss)\n' "$name" "$secs" >>"$out/results.tsv"
        else
            printf '%s\tkilled\t%s: %s (%ss)\n' "$name" "$which" "$first" "$secs" >>"$out/results.tsv"
        fi
    elif grep -q '^SURVIVED ' "$log"; then
        printf '%s\tpassed\t%s (%ss)\n' "$name" "$passed_what" "$secs" >>"$out/results.tsv"
    else
        printf '%s\terror\tmutants_hand.py exit %s: %s\n' "$name" "$rc" "$(tail -1 "$log")" >>"$out/results.tsv"
    fi
    tail -1 "$out/results.tsv"
done <"$names"
