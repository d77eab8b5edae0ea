#!/usr/bin/env bash
# One full GPU session, on the GPU machine from .gpu/ (it has no cargo). Stage it here with
# `bench/stage.sh` (or `bench/stage.sh path/to/trace.jsonl` for a longer trace than the built-in
# excerpt), call the device tool with carry [".gpu"] and `bash .gpu/gpu_session.sh`; the
# compute-sanitizer pass is `bash .gpu/gpu_sanitize.sh`. Outputs land in $OUT; record the run in
# kernels/GPU.md and copy the raw files to bench/results/.
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
timeout 300 "$G/bin/tierkv" bench --torch-json "$OUT/torch.jsonl" --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1; cat "$OUT/bench.md"
echo "=== sim --device cuda"
timeout 360 "$G/bin/tierkv" sim --device cuda --seeds 0..60 --jobs 12 --no-shrink --out-dir "$OUT" 2>&1 | tr '\r' '\n' | grep -v "^\[" > "$OUT/sim.log"; tail -5 "$OUT/sim.log"
echo "=== replay --device cuda"
timeout 400 "$G/bin/tierkv" replay --device cuda --trace "$G/data/trace.jsonl" --requests 120 --layers 4 --time-scale 5 > "$OUT/replay.log" 2>&1; echo "rc=$?"; tail -8 "$OUT/replay.log"
