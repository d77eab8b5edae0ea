#!/usr/bin/env bash
# Run 101 (kernels/GPU.md): run 100's slim GPU checks (issue 32), then the coverage targets'
# campaign on the machine's CPU cores (issue 33), cut at 300 s (a campaign ended by SIGTERM
# writes the seeds that ended).
set -u
bash .gpu/run100-slim.sh
OUT=${OUT:-/tmp/out}
echo "=== targets campaign"
nproc
timeout 300 .gpu/bin/tierkv-targets sim --seeds 0..2000 --jobs "$(nproc)" --no-shrink --keep-going \
    --coverage --json "$OUT/seeds-0-2000.json" > "$OUT/seeds-0-2000.txt" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/seeds-0-2000.txt" | grep -vE "^progress" | grep -E "seeds run|wall time|failing|^coverage|^targets|interrupt" | head -8
