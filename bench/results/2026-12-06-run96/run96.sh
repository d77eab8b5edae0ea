#!/usr/bin/env bash
# Run 96 (kernels/GPU.md): issue 35's CUDA graphs (`c46a15b`). `engine_it cuda_device` (the GPU
# engine equal to the CPU engine, with graphs on and off); kernel conformance; `tierkv replay
# --device cuda` at 61 layers (60 requests) and 4 layers (120 requests), arrivals /5, one step
# ahead, timed and untimed, of this build with graphs (the default) and without (`--no-graphs`)
# and of `6594ed9` (`tierkv-old`, before this session's runtime changes); `sim --device cuda`
# over 32 seeds; `host_cost` on this machine's CPU with graphs off and on. Staged by
# bench/stage.sh, with host_cost and tierkv-old copied into .gpu/bin. Run from the checkout,
# .gpu/ beside it.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "=== engine_it cuda_device"
timeout 90 "$G/bin/engine_it" cuda_device --test-threads 1 > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "^test |test result|panicked|FAILED" "$OUT/engine_cuda.log" | head -10
echo "=== kernel conformance"
timeout 90 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" "$OUT/conformance.log" | head -5
echo "=== host_cost (no GPU)"
for g in 0 1; do "$G/bin/host_cost" 61 60 1 $g; "$G/bin/host_cost" 4 120 1 $g; done | tee "$OUT/host_cost.log"
run() { # BUILD NAME LAYERS REQUESTS ARGS...
  local b=$1 name=$2 layers=$3 req=$4; shift 4
  f="$OUT/replays.log"
  echo "=== $b $name" >> "$f"
  timeout 150 "$G/bin/$b" replay --device cuda --trace "$G/data/trace.jsonl" --requests $req --layers $layers --time-scale 5 --overlap "$@" > /tmp/r.log 2>&1
  echo "=== $b $name rc=$?"
  grep -E "^finished|^step latency|computing steps|device ms per step|per op kind|kernel launches" /tmp/r.log | cut -c1-400 | tee -a "$f"
}
for layers in 61 4; do
  req=60; [ "$layers" = 4 ] && req=120
  run tierkv-old $layers-timed $layers $req
  run tierkv $layers-timed-graphs $layers $req
  run tierkv $layers-timed-nographs $layers $req --no-graphs
  run tierkv-old $layers-untimed $layers $req --no-device-timing
  run tierkv $layers-untimed-graphs $layers $req --no-device-timing
  run tierkv $layers-untimed-nographs $layers $req --no-device-timing --no-graphs
done
echo "=== sim --device cuda 0..32"
timeout 150 "$G/bin/tierkv" sim --device cuda --seeds 0..32 --jobs 16 --no-shrink --keep-going > "$OUT/sim.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/sim.log" | grep -vE "^progress" | grep -E "seeds run|failing|finding|FAIL" | head -8
