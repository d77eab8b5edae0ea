#!/usr/bin/env bash
# Run 85 (kernels/GPU.md): the GPU items at the commit of the typed CLI errors and the kernels'
# stand-in without CUDA (issue 34), with issue 32's ops and transfers again (H200 figures where an
# H200 is lent). Staged by bench/stage.sh plus the CUDA wheel in .gpu/wheels. Two calls, each
# under the device's 10 minutes: `run85.sh a` (conformance, the production CUDA device, the
# simulator on the GPU, the refusals of the CUDA build), then `run85.sh b` (pytest on the GPU,
# the ops beside `tierkv bench`, the host tier's transfers).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
part=${1:-a}
if [ "$part" = a ]; then
echo "=== kernel conformance"
timeout 150 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" "$OUT/conformance.log" | head
echo "=== the production CUDA device"
timeout 150 "$G/bin/engine_it" cuda_device --test-threads 1 > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" "$OUT/engine_cuda.log" | head
echo "=== sim --device cuda, 48 seeds"
timeout 240 "$G/bin/tierkv" sim --device cuda --seeds 0..48 --jobs 12 --no-shrink --out-dir "$OUT" > "$OUT/sim.log" 2>&1; echo "rc=$?"
grep -vE "^progress" "$OUT/sim.log" | tail -8
echo "=== refusals of the CUDA build (typed CLI errors)"
python3 -c "import socket,time,sys; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); print(s.getsockname()[1], flush=True); time.sleep(60)" > "$OUT/port.txt" &
sleep 1; port=$(head -1 "$OUT/port.txt")
"$G/bin/tierkv" replay --device cuda --requests 2 --layers 1 --device-pages 2048 --host-ratio 1.25 --metrics-port "$port"; echo "rc=$? (2 expected: the port is in use)"
"$G/bin/tierkv" replay --device cuda --pd --time-scale 3; echo "rc=$? (2 expected)"
"$G/bin/tierkv" replay --device cuda --requests 8 --layers 4 --time-scale 5 > "$OUT/replay.log" 2>&1; echo "rc=$?"; head -2 "$OUT/replay.log"; tail -4 "$OUT/replay.log"
fi
if [ "$part" = b ]; then
PY=/tmp/tierkv-py; rm -rf "$PY"; mkdir -p "$PY"
python3 -m zipfile -e "$G"/wheels/tierkv-*.whl "$PY"
export PYTHONPATH=$PY
python3 -c "import tierkv, torch; print(tierkv.__version__, tierkv.BACKENDS, torch.__version__, torch.cuda.get_device_name())"
echo "=== pytest python/tests on the GPU"
timeout 200 python3 -m pytest -q -p no:cacheprovider python/tests -rs > "$OUT/pytest.log" 2>&1; echo "rc=$?"
tail -6 "$OUT/pytest.log"
echo "=== ops_bench"
timeout 120 python3 bench/ops_bench.py "$OUT/ops.jsonl" > "$OUT/ops.log" 2>&1; echo "rc=$?"
tail -12 "$OUT/ops.log"
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
unset PYTHONPATH
echo "=== tierkv bench beside the ops"
timeout 150 "$G/bin/tierkv" bench --torch-json "$OUT/ops.jsonl" --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1; echo "rc=$?"
grep -iE "index_k_store|index_logits tensor|topk|torch" "$OUT/bench.md" | head -30
fi
