#!/usr/bin/env bash
# Run 83 (kernels/GPU.md): issue 32's torch ops on the GPU (pytest, bench/ops_bench.py beside
# `tierkv bench`), the host tier's transfers with the copy kernel (bench/offload_bench.py), kernel
# conformance after store.cu/page_copy.cu changed. Staged by bench/stage.sh plus the CUDA wheel
# in .gpu/wheels (maturin build --release --features cuda). Run from the checkout, in two calls
# (each under the device's 10 minutes): `run83.sh a`, then `OPS=ops.jsonl run83.sh b`.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
PY=/tmp/tierkv-py; rm -rf "$PY"; mkdir -p "$PY"
python3 -m zipfile -e "$G"/wheels/tierkv-*.whl "$PY"
export PYTHONPATH=$PY
python3 -c "import tierkv, torch; print(tierkv.__version__, tierkv.BACKENDS, torch.__version__, torch.cuda.get_device_name())"
part=${1:-a}
if [ "$part" = a ]; then
echo "=== pytest python/tests (10,000 stores right after a kernel, each path)"
TIERKV_STORE_ITERATIONS=10000 timeout 240 python3 -m pytest -q -p no:cacheprovider python/tests -rs > "$OUT/pytest.log" 2>&1; echo "rc=$?"
tail -30 "$OUT/pytest.log"
echo "=== ops_bench"
timeout 120 python3 bench/ops_bench.py "$OUT/ops.jsonl" > "$OUT/ops.log" 2>&1; echo "rc=$?"
cat "$OUT/ops.log" | tail -20
echo "=== offload_bench"
timeout 150 python3 bench/offload_bench.py "$OUT/offload.jsonl" > "$OUT/offload.log" 2>&1; echo "rc=$?"
python3 - "$OUT/offload.jsonl" <<'PY'
import json, sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("what") in ("tier", "one pinned copy"):
        rows[(r["what"], r["direction"], r["blocks"], r["layout"])].append((round(r["gbps"], 1), round(r.get("submit_ms", 0), 2)))
for k, v in sorted(rows.items()):
    print(k, v)
PY
fi
unset PYTHONPATH
if [ "$part" = b ]; then
echo "=== tierkv bench beside the ops (ops.jsonl from part a, carried in \$OPS)"
timeout 200 "$G/bin/tierkv" bench --torch-json "${OPS:-$OUT/ops.jsonl}" --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1; echo "rc=$?"
grep -iE "index_k_store|index_logits tensor|topk|torch" "$OUT/bench.md" | head -30
echo "=== kernel conformance"
timeout 120 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" "$OUT/conformance.log" | head
fi
