#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "=== harness"
timeout 150 $G/h/harness > "$OUT/harness.txt" 2>&1; echo "rc=$?"; grep -E "^---|C [1248]:|phases|MISMATCH|differ|path" "$OUT/harness.txt" | cut -c1-220
echo "=== kernel conformance"
timeout 120 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"; grep -E "test result|panicked|FAILED" "$OUT/conformance.log"
echo "=== torch bench"
timeout 150 python3 "$G/torch_bench.py" "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1; echo "rc=$?"; tail -2 "$OUT/torch.log"
echo "=== tierkv bench"
timeout 200 "$G/bin/tierkv" bench --torch-json "$OUT/torch.jsonl" --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1; echo "rc=$?"; grep -E "device copy|wgmma.*64 x 64K|topk|^\| (1|64|8) x" "$OUT/bench.md" | cut -c1-250
