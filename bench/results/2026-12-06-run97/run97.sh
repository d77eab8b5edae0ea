#!/usr/bin/env bash
# Run 97 (kernels/GPU.md): the graphs after their review (`71f0a3f`: thread-local capture, a
# capture a launcher refused dropped). `engine_it cuda_device`; `sim --device cuda` over 32
# seeds; `host_cost` with graphs off and on, twice; `tierkv replay --device cuda` at 61 layers,
# arrivals /5, one step ahead, untimed with and without graphs (twice each, alternated) and
# timed with graphs. Staged by bench/stage.sh, with host_cost copied into .gpu/bin.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "=== engine_it cuda_device"
timeout 90 "$G/bin/engine_it" cuda_device --test-threads 1 > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" "$OUT/engine_cuda.log" | head -5
echo "=== host_cost (no GPU)"
for i in 1 2; do for g in 0 1; do "$G/bin/host_cost" 61 60 1 $g; done; done | tee "$OUT/host_cost.log"
run() { # NAME ARGS...
  local name=$1; shift
  echo "=== $name" >> "$OUT/replays.log"
  timeout 150 "$G/bin/tierkv" replay --device cuda --trace "$G/data/trace.jsonl" --requests 60 --layers 61 --time-scale 5 --overlap "$@" > /tmp/r.log 2>&1
  echo "=== $name rc=$?"
  grep -E "^finished|computing steps|device ms per step|kernel launches" /tmp/r.log | cut -c1-330 | tee -a "$OUT/replays.log"
}
for i in 1 2; do
  run untimed-graphs-$i --no-device-timing
  run untimed-nographs-$i --no-device-timing --no-graphs
done
run timed-graphs
echo "=== sim --device cuda 0..32"
timeout 150 "$G/bin/tierkv" sim --device cuda --seeds 0..32 --jobs 16 --no-shrink --keep-going > "$OUT/sim.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/sim.log" | grep -vE "^progress" | grep -E "seeds run|failing|finding|FAIL" | head -8
