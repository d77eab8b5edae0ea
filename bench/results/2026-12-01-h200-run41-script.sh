#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "=== conformance: rope_rows, draw"
"$G/bin/kernels_it" cuda::rope_rows cuda::draw --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"; grep -E "test result|panicked" "$OUT/conformance.log"
echo "=== the production CUDA device"
"$G/bin/engine_it" cuda_device --test-threads 1 --nocapture > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "test result|digest rows|panicked" "$OUT/engine_cuda.log" | head -20
R="--device cuda --trace $G/data/trace.jsonl --requests 120 --layers 4 --time-scale 5"
for i in 1 2; do
echo "=== replay 4 layers ($i)"
timeout 60 $G/bin/tierkv replay $R > "$OUT/replay-$i.log" 2>&1; echo "rc=$?"; tail -5 "$OUT/replay-$i.log"
done
echo "=== replay 61 layers"
timeout 90 $G/bin/tierkv replay --device cuda --trace $G/data/trace.jsonl --requests 60 --layers 61 --time-scale 5 > "$OUT/replay-61.log" 2>&1; echo "rc=$?"; tail -5 "$OUT/replay-61.log"
echo "=== perf?"
which perf || ls /usr/bin/perf* 2>/dev/null | head -3
if command -v perf >/dev/null; then
  timeout 60 perf record -F 999 -g -o "$OUT/perf.data" $G/bin/tierkv replay $R > /dev/null 2>&1
  perf report -i "$OUT/perf.data" --no-children --sort dso,symbol 2>/dev/null | grep -v "^#" | grep "%" | grep -v "^ *-" | head -45 > "$OUT/perf.txt"; cat "$OUT/perf.txt" | cut -c1-160
fi
