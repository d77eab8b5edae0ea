#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "=== logits conformance"
"$G/bin/kernels_it" cuda::logits --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"; grep -E "test result|panicked|FAILED" "$OUT/conformance.log"
echo "=== tierkv bench"
timeout 170 "$G/bin/tierkv" bench --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1; echo "rc=$?"; grep -E "device copy|index_logits tensor-core \(wgmma\)( launcher)?.*64 x 64K|topk" "$OUT/bench.md" | head -20
