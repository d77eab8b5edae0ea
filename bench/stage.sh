#!/usr/bin/env bash
# Builds everything a GPU session runs and stages it in .gpu/ (ignored by git), for a GPU machine
# that has no cargo: the `tierkv` binary and the kernels' and engine's integration-test
# executables, all with `--features cuda`, stripped of debug info; a Mooncake trace; the session
# script and the PyTorch bench.
#
#   bench/stage.sh [TRACE.jsonl]     (default: the built-in excerpt, data/mooncake/)
#
# On the GPU machine, with .gpu/ beside the checkout: `bash .gpu/gpu_session.sh`, then
#   `bash .gpu/gpu_sanitize.sh` (outputs in $OUT).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
trace=${1:-data/mooncake/conversation_trace_excerpt.jsonl}
[ -f "$trace" ] || { echo "stage.sh: no trace at $trace" >&2; exit 2; }

rm -rf .gpu && mkdir -p .gpu/bin .gpu/data
cargo build --release -p tierkv-sim --features cuda
cp target/release/tierkv .gpu/bin/tierkv

# The `it` test executable of a crate (cargo names its path; the JSON messages say which).
stage_tests() {
  local crate=$1 name=$2
  cargo test --release -p "$crate" --features cuda --test it --no-run --message-format=json \
    | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"])
' | tail -n 1 | xargs -I{} cp {} ".gpu/bin/$name"
  [ -x ".gpu/bin/$name" ] || { echo "stage.sh: no test executable for $crate" >&2; exit 1; }
}
stage_tests tierkv-kernels kernels_it
stage_tests tierkv-engine engine_it
strip --strip-debug .gpu/bin/* 2>/dev/null || true

cp "$trace" .gpu/data/trace.jsonl
cp bench/gpu_session.sh bench/gpu_sanitize.sh bench/torch_bench.py .gpu/
echo "staged at $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (with uncommitted changes)'): $(du -sh .gpu | cut -f1) in .gpu/"
ls -la .gpu/bin
