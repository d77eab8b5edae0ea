#!/usr/bin/env bash
# Run 101 (kernels/GPU.md), CPU only: the default profile's coverage targets (issue 33 item 3:
# happens-before pairs, combinations, watermarks) over 2,000 seeds on the GPU machine's 16 cores.
# .gpu/bin/tierkv-targets is the plain release `tierkv` of the commit named in GPU.md.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nproc | tee "$OUT/cpus.txt"
timeout 560 .gpu/bin/tierkv-targets sim --seeds 0..2000 --jobs "$(nproc)" --no-shrink --keep-going \
    --coverage --json "$OUT/seeds-0-2000.json" > "$OUT/seeds-0-2000.txt" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/seeds-0-2000.txt" | grep -vE "^progress" | grep -E "seeds run|wall time|failing|^coverage|^targets" | head -8
