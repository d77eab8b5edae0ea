set -u
cd /work/main
eval "$(cargo llvm-cov show-env --export-prefix 2>/dev/null)"
export CARGO_TARGET_DIR=/tmp/covtarget CARGO_LLVM_COV_TARGET_DIR=/tmp/covtarget CARGO_LLVM_COV_BUILD_DIR=/tmp/covtarget
export LLVM_PROFILE_FILE=/tmp/covtarget/tierkv-%p-%2m.profraw
date
nice -n 19 cargo build --release -p tierkv-sim --bin tierkv 2>&1 | tail -1
date
seq 0 15 | xargs -P 2 -I{} sh -c 'nice -n 19 /tmp/covtarget/release/tierkv sim --seeds 0..200 --shard {}/16 --jobs 1 --keep-going --no-shrink > /tmp/cov/shard-{}.log 2>&1; echo "shard {} rc=$?"'
date
cargo llvm-cov report --release --summary-only 2>&1 | grep -E "runtime/|TOTAL" 
cargo llvm-cov report --release --text --output-path /tmp/cov/runtime.txt 2>&1 | tail -2
echo DONE
