#!/usr/bin/env bash
# Run 95 (kernels/GPU.md): what each driver call costs the host, before choosing how CUDA graphs
# enter the runtime (issue 35): `launch_costs` (engine/examples/launch_costs.rs) at 16 and 8 nodes;
# `host_cost` on this machine's CPU; `tierkv replay --device cuda` at 61 layers (60 requests) and
# 4 layers (120 requests), arrivals /5, one step ahead, with and without the per-op timing events
# (`--no-device-timing`), of this build (`tierkv`) and of the build before its per-stream output
# allocation (`tierkv-old`, `6594ed9`); then the checks of run 94 at this commit (kernel
# conformance, `engine_it cuda_device`, `sim --device cuda` over 32 seeds). Staged by
# bench/stage.sh, with launch_costs, host_cost and tierkv-old copied into .gpu/bin. Run from the
# checkout, .gpu/ beside it.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "=== launch_costs"
for n in 16 8; do timeout 60 "$G/bin/launch_costs" $n 2>&1 | tee -a "$OUT/launch_costs.log"; done
echo "=== host_cost (no GPU)"
"$G/bin/host_cost" 61 60 1 | tee "$OUT/host_cost.log"
"$G/bin/host_cost" 4 120 1 | tee -a "$OUT/host_cost.log"
run() { # BUILD NAME LAYERS REQUESTS ARGS...
  local b=$1 name=$2 layers=$3 req=$4; shift 4
  f="$OUT/replay-$name-$b.log"
  timeout 150 "$G/bin/$b" replay --device cuda --trace "$G/data/trace.jsonl" --requests $req --layers $layers --time-scale 5 "$@" > "$f" 2>&1
  echo "=== $b $name rc=$?"
  grep -E "^finished|^step latency|computing steps|device ms per step|per op kind" "$f" | cut -c1-700
}
for b in tierkv-old tierkv; do
  run $b 61-timed 61 60 --overlap
  run $b 61-untimed 61 60 --overlap --no-device-timing
  run $b 4-timed 4 120 --overlap
  run $b 4-untimed 4 120 --overlap --no-device-timing
done
echo "=== kernel conformance"
timeout 90 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" "$OUT/conformance.log" | head -24
echo "=== engine_it cuda_device"
timeout 60 "$G/bin/engine_it" cuda_device --test-threads 1 > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "^test |test result|panicked|FAILED" "$OUT/engine_cuda.log" | head -8
echo "=== sim --device cuda 0..32"
timeout 150 "$G/bin/tierkv" sim --device cuda --seeds 0..32 --jobs 16 --no-shrink --keep-going > "$OUT/sim.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/sim.log" | grep -vE "^progress" | tail -8
