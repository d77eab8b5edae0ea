#!/usr/bin/env bash
# Run 90 (kernels/GPU.md): `tierkv replay --device cuda` at 61 layers, this build against
# `.gpu/bin/tierkv-old` (305dbaa, before the driver seam, patched only to print how long the
# engine took to build on its thread, as this build now does), three runs each, alternating;
# then `tierkv bench --reps 5` (its launches now go through the argument records).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for run in new old new2 old2 new3 old3; do
  bin=$G/bin/tierkv; case $run in old*) bin=$G/bin/tierkv-old;; esac
  echo "=== replay --device cuda 61 layers ($run)"
  timeout 55 "$bin" replay --device cuda --trace "$G/data/trace.jsonl" --requests 60 --layers 61 --time-scale 5 > "$OUT/replay-61-$run.log" 2>&1; echo "rc=$?"
  grep -E "^engine built|^finished|step latency|computing steps" "$OUT/replay-61-$run.log" | head -5
done
echo "=== tierkv bench --reps 5"
timeout 120 "$G/bin/tierkv" bench --reps 5 --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1; echo "rc=$?"
grep -iE "mismatch|differ|index_k_store 1M|index_logits tensor-core \(wgmma\) 64|topk k=|launcher" "$OUT/bench.md" | head -24
tail -3 "$OUT/bench.log"
