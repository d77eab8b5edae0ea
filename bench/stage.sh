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

command -v python3 >/dev/null || { echo "stage.sh: needs python3 (to read cargo's JSON messages)" >&2; exit 2; }
command -v strip >/dev/null || { echo "stage.sh: needs strip (binutils)" >&2; exit 2; }
rm -rf .gpu && mkdir -p .gpu/bin .gpu/data

# The executable cargo built for the target named $1, read from cargo's JSON messages on stdin
# (wherever CARGO_TARGET_DIR puts it).
executable() {
  python3 -c '
import json, sys
want = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == want:
        print(m["executable"])
' "$1" | tail -n 1
}

# stage TARGET AS CARGO-ARGS...: builds with `--features cuda` and copies the executable of
# target TARGET to .gpu/bin/AS, stripped of debug info.
stage() {
  local target=$1 as=$2; shift 2
  local exe
  exe=$(cargo "$@" --release --features cuda --message-format=json-render-diagnostics | executable "$target")
  [ -n "$exe" ] && [ -x "$exe" ] || { echo "stage.sh: cargo built no $target" >&2; exit 1; }
  cp "$exe" ".gpu/bin/$as"
  strip --strip-debug ".gpu/bin/$as"
}
stage tierkv tierkv build -p tierkv-sim --bin tierkv
stage it kernels_it test -p tierkv-kernels --test it --no-run
stage it engine_it test -p tierkv-engine --test it --no-run

cp "$trace" .gpu/data/trace.jsonl
cp bench/gpu_session.sh bench/gpu_sanitize.sh bench/torch_bench.py .gpu/
echo "staged at $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (with uncommitted changes)'): $(du -sh .gpu | cut -f1) in .gpu/"
ls -la .gpu/bin
