# Line coverage of engine/src/runtime/ under the default campaign, seeds 0..200 (issue 30), at
# the commit that resolves issue 30: the method of ../2026-12-06-runtime-coverage-2/run.sh with
# the instrumentation flag set by hand (rustc's `-C instrument-coverage`, what cargo-llvm-cov's
# `show-env` sets) and llvm-tools from rustup: an instrumented release `tierkv`, 16 one-thread
# shards two at a time, then llvm-profdata/llvm-cov.
set -u
cd /work/main
export RUSTFLAGS="-C instrument-coverage" CARGO_TARGET_DIR=/tmp/covtarget
export LLVM_PROFILE_FILE=/tmp/covtarget/tierkv-%p-%2m.profraw
rm -f /tmp/covtarget/*.profraw; mkdir -p /tmp/cov3
date
nice -n 19 cargo build --release -p tierkv-sim --bin tierkv 2>&1 | tail -1
date
seq 0 15 | xargs -P 2 -I{} sh -c 'nice -n 19 /tmp/covtarget/release/tierkv sim --seeds 0..200 --shard {}/16 --jobs 1 --keep-going --no-shrink > /tmp/cov3/shard-{}.log 2>&1; echo "shard {} rc=$?"'
date
B=~/.rustup/toolchains/1.95.0-x86_64-unknown-linux-gnu/lib/rustlib/x86_64-unknown-linux-gnu/bin
$B/llvm-profdata merge -sparse /tmp/covtarget/tierkv-*.profraw -o /tmp/cov3/sim.profdata
$B/llvm-cov report /tmp/covtarget/release/tierkv -instr-profile=/tmp/cov3/sim.profdata > /tmp/cov3/report.txt
for f in driven driver mod ring staging; do
  $B/llvm-cov show /tmp/covtarget/release/tierkv -instr-profile=/tmp/cov3/sim.profdata engine/src/runtime/$f.rs \
    | grep -E '^ *[0-9]+\| *0\|' | sed "s/^/$f.rs:/"
done > /tmp/cov3/uncovered-lines.txt
echo DONE
