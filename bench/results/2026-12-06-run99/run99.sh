#!/usr/bin/env bash
# Run 99 (kernels/GPU.md): looking for run 95's one `sim --device cuda` topk finding (seed 22,
# never seen again): compute-sanitizer racecheck and initcheck over the top-k conformance
# tests, then `sim --device cuda` over seeds 0..96 twice. Binaries of run 98 (.gpu/).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CS=/usr/local/cuda/bin/compute-sanitizer
for tool in racecheck initcheck; do
  t0=$SECONDS
  timeout 120 $CS --tool $tool --error-exitcode 86 --print-limit 20 "$G/bin/kernels_it" topk --test-threads 1 > "$OUT/sanitize-$tool-topk.log" 2>&1
  echo "$tool topk: rc=$? in $((SECONDS - t0)) s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool-topk.log" | tail -1); $(grep -cE '^test .* ok$' "$OUT/sanitize-$tool-topk.log") tests ok"
done
for i in 1 2; do
  t0=$SECONDS
  timeout 150 "$G/bin/tierkv" sim --device cuda --seeds 0..96 --jobs 16 --no-shrink --keep-going > "$OUT/sim-$i.log" 2>&1
  echo "sim 0..96 #$i: rc=$? in $((SECONDS - t0)) s"
  tr '\r' '\n' < "$OUT/sim-$i.log" | grep -vE "^progress" | grep -E "seeds run|failing|finding|FAIL" | head -6
done
