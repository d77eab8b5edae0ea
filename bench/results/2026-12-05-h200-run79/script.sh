#!/usr/bin/env bash
# Run 79 (kernels/GPU.md): issue 30's GPU acceptance at a48fcc1 (the host's decisions in the
# schedule). Staged by bench/stage.sh, plus .gpu/bin/tierkv-old built at 305dbaa (before the
# driver seam) for the replay comparison; the builds alternate. Run from the checkout with .gpu/
# beside it.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "=== kernel conformance"
timeout 170 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" "$OUT/conformance.log" | head
echo "=== engine_it cuda_device"
timeout 120 "$G/bin/engine_it" cuda_device --test-threads 1 --nocapture > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "^test |test result|GPU engine|digest rows|panicked" "$OUT/engine_cuda.log" | head -12
echo "=== sim --device cuda 0..48"
timeout 150 "$G/bin/tierkv" sim --device cuda --seeds 0..48 --jobs 12 --no-shrink --keep-going --out-dir "$OUT" > "$OUT/sim.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/sim.log" | grep -vE "^\[" | tail -12
for run in new old new2 old2; do
  bin=$G/bin/tierkv; case $run in old*) bin=$G/bin/tierkv-old;; esac
  echo "=== replay --device cuda 61 layers ($run)"
  timeout 80 "$bin" replay --device cuda --trace "$G/data/trace.jsonl" --requests 60 --layers 61 --time-scale 5 > "$OUT/replay-61-$run.log" 2>&1; echo "rc=$?"
  grep -E "^finished|step latency|computing steps|device ms" "$OUT/replay-61-$run.log" | head -8
done
for run in new old new2 old2; do
  bin=$G/bin/tierkv; case $run in old*) bin=$G/bin/tierkv-old;; esac
  echo "=== replay --device cuda 4 layers ($run)"
  timeout 60 "$bin" replay --device cuda --trace "$G/data/trace.jsonl" --requests 120 --layers 4 --time-scale 5 > "$OUT/replay-4-$run.log" 2>&1; echo "rc=$?"
  grep -E "step latency|computing steps|per op kind" "$OUT/replay-4-$run.log" | head -5
done
