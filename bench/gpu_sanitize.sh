#!/usr/bin/env bash
# compute-sanitizer over tierkv's GPU code, on the GPU machine from .gpu/ (bench/stage.sh):
#   memcheck   out-of-bounds and misaligned device accesses, failed API calls
#   racecheck  shared-memory hazards between a block's threads (the tensor-core logits kernels
#              stage pages in shared memory)
#   initcheck  device reads of global memory nothing wrote
# over the kernels' conformance tests, the production CUDA device's engine tests and a short
# `sim --device cuda`. Each run's log is $OUT/sanitize-<tool>-<what>.log; a line per run says
# its exit code and the sanitizer's error summary (exit 86 = the sanitizer found errors).
# A machine whose runtime cannot host the sanitizer (it answers "Device not supported") is
# reported as such, not as a pass.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=$(dirname "$0")
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CS=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
[ -x "$CS" ] || CS=$(command -v compute-sanitizer) || { echo "no compute-sanitizer"; exit 2; }
"$CS" --version | tail -1

status=0
# sanitize TOOL WHAT SECONDS COMMAND...
sanitize() {
  local tool=$1 what=$2 secs=$3; shift 3
  local log="$OUT/sanitize-$tool-$what.log"
  local t0=$SECONDS
  timeout "$secs" "$CS" --tool "$tool" --error-exitcode 86 --print-limit 50 "$@" >"$log" 2>&1
  local rc=$?
  local summary
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -n 1)
  if grep -q "Device not supported" "$log"; then summary="the sanitizer does not support this device"; fi
  echo "$tool $what: rc=$rc in $((SECONDS - t0)) s; ${summary:-no summary}; $(grep -cE '^test .* ok$' "$log") tests ok"
  [ "$rc" = 0 ] || status=1
}

conformance=("$G/bin/kernels_it" cuda --test-threads 1)
engine=("$G/bin/engine_it" cuda_device --test-threads 1)
# Swarm seeds 0..4 load pages back from the host (23 loads, 66 backups, 6 failed copies on the CPU).
sim=("$G/bin/tierkv" sim --device cuda --seeds 0..4 --jobs 1 --no-shrink --out-dir "$OUT")

sanitize memcheck conformance 150 "${conformance[@]}"
sanitize memcheck engine 120 "${engine[@]}"
sanitize memcheck sim 120 "${sim[@]}"
sanitize racecheck conformance 150 "${conformance[@]}"
sanitize initcheck conformance 90 "${conformance[@]}"
sanitize initcheck engine 120 "${engine[@]}"
sanitize racecheck engine 120 "${engine[@]}"
sanitize initcheck sim 120 "${sim[@]}"
exit $status
