#!/usr/bin/env bash
# Run 100, slim (kernels/GPU.md): what a short device budget allows of run100.sh: the GPU pytest
# (the host tier's copy path, the pool of copy lists, top-k's length -1), offload_bench once
# (the first job after the kernel compiled at registration), engine_it cuda_device.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
py=/tmp/tierkv-new; rm -rf "$py"; mkdir -p "$py"; python3 -m zipfile -e "$G"/wheels/new/tierkv-*.whl "$py"; export PYTHONPATH=$py
echo "=== pytest (new wheel)"
TIERKV_STORE_ITERATIONS=10000 timeout 100 python3 -m pytest -q -p no:cacheprovider python/tests/test_cuda_ops.py python/tests/test_torch_ops.py python/tests/test_cuda.py -rs > $L/pytest.log 2>&1; echo "rc=$?"
grep -E "passed|failed|FAILED|Error" $L/pytest.log | tail -12
echo "=== offload_bench"
timeout 80 python3 bench/offload_bench.py "$OUT/offload.jsonl" > $L/offload.log 2>&1; echo "rc=$?"
python3 - "$OUT/offload.jsonl" <<'PY'
import json, sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("what") == "setup":
        print("setup", round(r["seconds"], 3), "s,", round(r["host_gib"], 2), "GiB, copy path", r.get("copy_path"))
    if r.get("what") in ("tier", "one pinned copy"):
        rows[(r["what"], r["direction"], r["blocks"], r["layout"])].append(
            (round(r["gbps"], 1), round(r.get("submit_ms", 0), 2), round(r.get("gpu_ms", 0), 2), round(r["wall_ms"], 2)))
for k, v in sorted(rows.items()):
    print(k, "(GB/s, submit ms, gpu ms, wall ms)", v)
PY
unset PYTHONPATH
echo "=== engine_it cuda_device"
timeout 60 "$G/bin/engine_it" cuda_device --test-threads 1 > $L/engine.log 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" $L/engine.log | head -4
tar czf "$OUT/logs.tgz" -C $L .
