#!/usr/bin/env bash
# Run 81 (kernels/GPU.md; ran on an H100, kind nvidia-h100-x1, no H200 being lent): the Python package's GPU tests and the host tier's transfer bench
# (issue 32), then issue 30's GPU items again (context recreation, a step cut by a recreation,
# keyed draws, the YaRN rule, the copies-only driver). Staged by bench/stage.sh plus the cuda
# wheel in .gpu/wheels (maturin build --release --features cuda). Run from the checkout.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "=== python: the wheel"
PY=/tmp/tierkv-py; rm -rf "$PY"; mkdir -p "$PY"
python3 -m zipfile -e "$G"/wheels/tierkv-*.whl "$PY"
export PYTHONPATH=$PY
python3 -c "import tierkv, torch; print(tierkv.__version__, tierkv.BACKENDS, torch.__version__, torch.cuda.get_device_name())"
echo "=== python: pytest (10,000 stores right after a kernel)"
TIERKV_STORE_ITERATIONS=10000 timeout 200 python3 -m pytest -q -p no:cacheprovider python/tests -rs > "$OUT/pytest.log" 2>&1; echo "rc=$?"
tail -25 "$OUT/pytest.log"
echo "=== python: the host tier's transfers against one pinned copy"
timeout 150 python3 "$G/offload_bench.py" "$OUT/offload.jsonl" > "$OUT/offload.log" 2>&1; echo "rc=$?"
tail -40 "$OUT/offload.log"
unset PYTHONPATH
echo "=== kernel conformance"
timeout 120 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" "$OUT/conformance.log" | head
echo "=== engine_it cuda_device"
timeout 90 "$G/bin/engine_it" cuda_device --test-threads 1 --nocapture > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "^test |test result|GPU engine|digest rows|panicked" "$OUT/engine_cuda.log" | head -12
echo "=== sim --device cuda 0..48"
timeout 150 "$G/bin/tierkv" sim --device cuda --seeds 0..48 --jobs 12 --no-shrink --keep-going --out-dir "$OUT" > "$OUT/sim.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/sim.log" | grep -vE "^\[" | tail -8
echo "=== replay --device cuda 61 layers"
timeout 60 "$G/bin/tierkv" replay --device cuda --trace "$G/data/trace.jsonl" --requests 60 --layers 61 --time-scale 5 > "$OUT/replay-61.log" 2>&1; echo "rc=$?"
grep -E "^finished|step latency|computing steps|device ms" "$OUT/replay-61.log" | head -8
