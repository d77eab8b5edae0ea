#!/usr/bin/env bash
# One full GPU session (runs on the GPU machine from .gpu/, which has no cargo). Stage it here:
#
#   cargo build --release -p tierkv-sim --features cuda
#   ../shared/tools/gpu-stage -p tierkv-kernels --features cuda --test it && cp .gpu/bin/it /tmp/kernels_it
#   ../shared/tools/gpu-stage -p tierkv-engine --features cuda --test it && mv .gpu/bin/it .gpu/bin/engine_it
#   cp /tmp/kernels_it .gpu/bin/kernels_it
#   cp target/release/tierkv .gpu/bin-tierkv && strip --strip-debug .gpu/bin-tierkv
#   mkdir -p .gpu/data && cp ../shared/data/mooncake/conversation_trace.jsonl .gpu/data/
#   cp bench/torch_bench.py bench/gpu_session.sh .gpu/
#
# then call the device tool with carry [".gpu"] and `bash .gpu/gpu_session.sh`. Outputs land in
# $OUT; record the run in kernels/GPU.md and copy the raw files to bench/results/.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=$(dirname "$0")
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "=== kernel conformance"
"$G/bin/kernels_it" cuda --test-threads 1 --nocapture > "$OUT/conformance.log" 2>&1; echo "rc=$?"
grep -E "^test |test result|bit-exact|worst error|panicked" "$OUT/conformance.log" | head -60
echo "=== the production CUDA device"
"$G/bin/engine_it" cuda_device --test-threads 1 --nocapture > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "^test |test result|GPU engine|digest rows|panicked" "$OUT/engine_cuda.log" | head -20
echo "=== torch bench"
timeout 300 python3 "$G/torch_bench.py" "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1; tail -3 "$OUT/torch.log"
echo "=== tierkv bench"
timeout 300 "$G/bin-tierkv" bench --torch-json "$OUT/torch.jsonl" --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1; cat "$OUT/bench.md"
echo "=== sim --device cuda"
timeout 360 "$G/bin-tierkv" sim --device cuda --seeds 0..60 --jobs 12 --no-shrink --out-dir "$OUT" 2>&1 | tr '\r' '\n' | grep -v "^\[" > "$OUT/sim.log"; tail -5 "$OUT/sim.log"
echo "=== replay --device cuda"
timeout 400 "$G/bin-tierkv" replay --device cuda --trace "$G/data/conversation_trace.jsonl" --requests 120 --layers 4 --time-scale 5 > "$OUT/replay.log" 2>&1; echo "rc=$?"; tail -8 "$OUT/replay.log"
