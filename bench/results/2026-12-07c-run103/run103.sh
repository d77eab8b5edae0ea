#!/usr/bin/env bash
# Run 103 (kernels/GPU.md): issue 35's acceptance figures with both builds in one run: `tierkv`
# of this commit (`bench/stage.sh`, `--features cuda`) against `tierkv` of 313e41f, the commit
# the issue measured before its work (built alike, copied in as .gpu/bin/tierkv-old).
# `engine_it cuda_device` (graphs on); `tierkv replay --device cuda` of the built-in excerpt,
# arrivals /5, one step ahead, at 61 layers (60 requests) and 4 layers (120 requests), untimed
# twice and timed once, the builds alternated. Every replay's whole output is kept in $OUT.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "=== engine_it cuda_device"
timeout 120 "$G/bin/engine_it" cuda_device --test-threads 1 > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "^test |test result|panicked|FAILED" "$OUT/engine_cuda.log" | head -10
n=0
run() { # BUILD NAME LAYERS REQUESTS ARGS...
  local b=$1 name=$2 layers=$3 req=$4; shift 4
  n=$((n + 1))
  local f="$OUT/$(printf '%02d' $n)-$b-$name.log"
  local t0=$SECONDS
  timeout 150 "$G/bin/$b" replay --device cuda --trace "$G/data/trace.jsonl" --requests $req --layers $layers --time-scale 5 --overlap "$@" > "$f" 2>&1
  echo "=== $b $name rc=$? in $((SECONDS - t0)) s"
  grep -E "^finished|computing steps|device ms per step|kernel launches|graph" "$f" | cut -c1-400
}
for i in 1 2; do
  run tierkv-old 61-untimed-$i 61 60 --no-device-timing
  run tierkv 61-untimed-$i 61 60 --no-device-timing
done
run tierkv-old 61-timed 61 60
run tierkv 61-timed 61 60
for i in 1 2; do
  run tierkv-old 4-untimed-$i 4 120 --no-device-timing
  run tierkv 4-untimed-$i 4 120 --no-device-timing
done
run tierkv-old 4-timed 4 120
run tierkv 4-timed 4 120
