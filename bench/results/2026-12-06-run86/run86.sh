#!/usr/bin/env bash
# Run 86 (kernels/GPU.md): issue 30's GPU acceptance at a40d594 (strict PCT holds; copy lists from pinned memory), whether CUDA
# lets a context in a sticky error be recreated (sticky.py), and issue 32's ops and transfers.
# Staged by bench/stage.sh, the CUDA wheel in .gpu/wheels, and .gpu/bin/tierkv-old built at
# 305dbaa (before the driver seam) for the replay comparison; the builds alternate. Two calls:
# `run86.sh a`, then `run86.sh b`; or, where the device time left allows one call only,
# `run86.sh c`: the new parts first (sticky.py, the GPU tests, the ops against `tierkv bench`,
# the transfers), then the GPU items of issue 30 with one replay of each build. Run from the
# checkout with .gpu/ beside it. `run86.sh d`: sticky.py and the CUDA-graph and registered-op
# tests only (for a device budget almost spent).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
R=bench/results/2026-12-06-run86
part=${1:-a}
if [ "$part" = a ]; then
echo "=== kernel conformance"
timeout 170 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" "$OUT/conformance.log" | head
echo "=== engine_it cuda_device"
timeout 120 "$G/bin/engine_it" cuda_device --test-threads 1 --nocapture > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "^test |test result|GPU engine|digest rows|panicked" "$OUT/engine_cuda.log" | head -12
echo "=== sim --device cuda 0..48"
timeout 150 "$G/bin/tierkv" sim --device cuda --seeds 0..48 --jobs 12 --no-shrink --keep-going --out-dir "$OUT" > "$OUT/sim.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/sim.log" | grep -vE "^\[" | tail -12
for run in new old new2 old2; do
  bin=$G/bin/tierkv; case $run in old*) bin=$G/bin/tierkv-old;; esac
  echo "=== replay --device cuda 61 layers ($run)"
  timeout 80 "$bin" replay --device cuda --trace "$G/data/trace.jsonl" --requests 60 --layers 61 --time-scale 5 > "$OUT/replay-61-$run.log" 2>&1; echo "rc=$?"
  grep -E "^finished|step latency|computing steps|device ms" "$OUT/replay-61-$run.log" | head -8
done
for run in new old new2 old2; do
  bin=$G/bin/tierkv; case $run in old*) bin=$G/bin/tierkv-old;; esac
  echo "=== replay --device cuda 4 layers ($run)"
  timeout 60 "$bin" replay --device cuda --trace "$G/data/trace.jsonl" --requests 120 --layers 4 --time-scale 5 > "$OUT/replay-4-$run.log" 2>&1; echo "rc=$?"
  grep -E "step latency|computing steps|per op kind" "$OUT/replay-4-$run.log" | head -5
done
echo "=== a sticky error and a context recreated (sticky.py)"
timeout 60 python3 $R/sticky.py 2>&1 | tee "$OUT/sticky.log"; echo "rc=$?"
fi
if [ "$part" = b ]; then
PY=/tmp/tierkv-py; rm -rf "$PY"; mkdir -p "$PY"
python3 -m zipfile -e "$G"/wheels/tierkv-*.whl "$PY"
export PYTHONPATH=$PY
python3 -c "import tierkv, torch; print(tierkv.__version__, tierkv.BACKENDS, torch.__version__, torch.cuda.get_device_name())"
echo "=== pytest python/tests (10,000 stores right after a kernel, each path)"
TIERKV_STORE_ITERATIONS=10000 timeout 240 python3 -m pytest -q -p no:cacheprovider python/tests -rs > "$OUT/pytest.log" 2>&1; echo "rc=$?"
tail -8 "$OUT/pytest.log"
echo "=== ops_bench"
timeout 120 python3 bench/ops_bench.py "$OUT/ops.jsonl" > "$OUT/ops.log" 2>&1; echo "rc=$?"
tail -16 "$OUT/ops.log"
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
if [ "$part" = c ]; then
echo "=== a sticky error and a context recreated (sticky.py)"
timeout 30 python3 $R/sticky.py > "$OUT/sticky.log" 2>&1; echo "rc=$?"; cat "$OUT/sticky.log"
PY=/tmp/tierkv-py; rm -rf "$PY"; mkdir -p "$PY"
python3 -m zipfile -e "$G"/wheels/tierkv-*.whl "$PY"
export PYTHONPATH=$PY
python3 -c "import tierkv, torch; print(tierkv.__version__, tierkv.BACKENDS, torch.__version__, torch.cuda.get_device_name())"
echo "=== pytest: the GPU tests (10,000 stores right after a kernel, each path), the registered ops"
TIERKV_STORE_ITERATIONS=10000 timeout 150 python3 -m pytest -q -p no:cacheprovider python/tests/test_cuda_ops.py python/tests/test_torch_ops.py python/tests/test_cuda.py -rs > "$OUT/pytest.log" 2>&1; echo "rc=$?"
grep -E "passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -12
echo "=== ops_bench"
timeout 90 python3 bench/ops_bench.py "$OUT/ops.jsonl" > "$OUT/ops.log" 2>&1; echo "rc=$?"
tail -14 "$OUT/ops.log"
echo "=== offload_bench"
timeout 90 python3 bench/offload_bench.py "$OUT/offload.jsonl" > "$OUT/offload.log" 2>&1; echo "rc=$?"
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
echo "=== tierkv bench beside the ops (5 reps)"
timeout 90 "$G/bin/tierkv" bench --reps 5 --torch-json "$OUT/ops.jsonl" --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1; echo "rc=$?"
grep -iE "index_k_store|index_logits tensor|topk" "$OUT/bench.md" | head -20
echo "=== kernel conformance"
timeout 60 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" "$OUT/conformance.log" | head -4
echo "=== engine_it cuda_device"
timeout 60 "$G/bin/engine_it" cuda_device --test-threads 1 > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" "$OUT/engine_cuda.log" | head -4
echo "=== sim --device cuda 0..48"
timeout 130 "$G/bin/tierkv" sim --device cuda --seeds 0..48 --jobs 16 --no-shrink --keep-going --out-dir "$OUT" > "$OUT/sim.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/sim.log" | grep -E "seeds run|wall time|coverage" | tail -4
for run in new old; do
  bin=$G/bin/tierkv; case $run in old*) bin=$G/bin/tierkv-old;; esac
  echo "=== replay --device cuda 61 layers ($run)"
  timeout 55 "$bin" replay --device cuda --trace "$G/data/trace.jsonl" --requests 60 --layers 61 --time-scale 5 > "$OUT/replay-61-$run.log" 2>&1; echo "rc=$?"
  grep -E "^finished|step latency|computing steps" "$OUT/replay-61-$run.log" | head -4
done
fi
if [ "$part" = d ]; then
echo "=== a sticky error and a context recreated (sticky.py)"
timeout 30 python3 $R/sticky.py > "$OUT/sticky.log" 2>&1; echo "rc=$?"; cat "$OUT/sticky.log"
PY=/tmp/tierkv-py; rm -rf "$PY"; mkdir -p "$PY"
python3 -m zipfile -e "$G"/wheels/tierkv-*.whl "$PY"
export PYTHONPATH=$PY
echo "=== pytest: CUDA graphs, the registered ops"
timeout 80 python3 -m pytest -q -p no:cacheprovider python/tests/test_cuda_ops.py python/tests/test_torch_ops.py -rs > "$OUT/pytest.log" 2>&1; echo "rc=$?"
grep -E "passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -12
fi
