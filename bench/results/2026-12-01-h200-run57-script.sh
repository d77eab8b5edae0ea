#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "=== logits conformance"
timeout 120 "$G/bin/kernels_it" cuda::logits --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"; grep -E "test result|panicked|FAILED" "$OUT/conformance.log"
for i in 1 2; do
echo "=== tierkv bench $i"
timeout 200 "$G/bin/tierkv" bench --out "$OUT/bench$i.md" > "$OUT/bench$i.log" 2>&1; echo "rc=$?"; grep -E "device copy 2|wgmma\)( launcher)?.*64 x 64K|topk k|^\| (fp8|bf16) \| wgmma" "$OUT/bench$i.md" | cut -c1-150
done
