#!/usr/bin/env bash
# Run 98 (kernels/GPU.md): the RoPE table made for the whole context before the first step
# (`DrivenDevice::prepare_rope`) and the used pages of a step's checks by a bitmap, against
# `tierkv` of `1b870ce` (as `tierkv-old`, `host_cost-old`). `engine_it cuda_device`;
# `host_cost` of both builds; `tierkv replay --device cuda` at 61 layers (60 requests) and 4
# layers (120 requests), arrivals /5, one step ahead, timed and untimed, the builds
# alternated, twice at 61 layers; `sim --device cuda` over 32 seeds. Staged by bench/stage.sh
# with host_cost, host_cost-old and tierkv-old copied into .gpu/bin.
#   bash .gpu/run98.sh PART     PART 1: checks, host_cost, 61 layers; PART 2: 4 layers, sim
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
part=${1:-1}
run() { # BUILD NAME LAYERS REQUESTS ARGS...
  local b=$1 name=$2 layers=$3 req=$4; shift 4
  f="$OUT/replays-$part.log"
  echo "=== $b $name" >> "$f"
  timeout 150 "$G/bin/$b" replay --device cuda --trace "$G/data/trace.jsonl" --requests $req --layers $layers --time-scale 5 --overlap "$@" > /tmp/r.log 2>&1
  echo "=== $b $name rc=$?"
  grep -E "^finished|computing steps|device ms per step|kernel launches" /tmp/r.log | cut -c1-400 | tee -a "$f"
}
if [ "$part" = 1 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  echo "=== engine_it cuda_device"
  timeout 120 "$G/bin/engine_it" cuda_device --test-threads 1 > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
  grep -E "^test |test result|panicked|FAILED" "$OUT/engine_cuda.log" | head -10
  echo "=== host_cost (no GPU)"
  for b in host_cost-old host_cost; do for a in "61 60 1 1" "4 120 1 1"; do echo "$b $a"; "$G/bin/$b" $a; done; done 2>&1 | tee "$OUT/host_cost.log"
  for i in 1 2; do
    run tierkv-old 61-untimed-$i 61 60 --no-device-timing
    run tierkv 61-untimed-$i 61 60 --no-device-timing
  done
  run tierkv-old 61-timed 61 60
  run tierkv 61-timed 61 60
else
  run tierkv-old 4-untimed 4 120 --no-device-timing
  run tierkv 4-untimed 4 120 --no-device-timing
  run tierkv-old 4-timed 4 120
  run tierkv 4-timed 4 120
  run tierkv 4-untimed-nographs 4 120 --no-device-timing --no-graphs
  run tierkv 4-timed-nographs 4 120 --no-graphs
  echo "=== sim --device cuda 0..32"
  timeout 150 "$G/bin/tierkv" sim --device cuda --seeds 0..32 --jobs 16 --no-shrink --keep-going > "$OUT/sim.log" 2>&1; echo "rc=$?"
  tr '\r' '\n' < "$OUT/sim.log" | grep -vE "^progress" | grep -E "seeds run|failing|finding|FAIL|checked" | head -8
fi
