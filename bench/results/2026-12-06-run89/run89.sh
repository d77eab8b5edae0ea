#!/usr/bin/env bash
# Run 89 (kernels/GPU.md): issue 30's GPU acceptance after the argument records (item 1), which
# changed every CUDA launcher's signature: kernel conformance, `engine_it cuda_device`,
# `tierkv sim --device cuda` over 48 seeds, the GPU pytests (the guarded launches of
# `tierkv.ops` now take the records' limits), and `tierkv replay --device cuda` at 61 layers
# against `.gpu/bin/tierkv-old` (305dbaa, before the driver seam), the builds alternating.
# Staged by bench/stage.sh, the CUDA wheel in .gpu/wheels. Run from the checkout, .gpu/ beside it.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "=== kernel conformance"
timeout 90 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"
grep -E "^test |test result|panicked|FAILED" "$OUT/conformance.log" | head -24
echo "=== engine_it cuda_device"
timeout 60 "$G/bin/engine_it" cuda_device --test-threads 1 > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "^test |test result|panicked|FAILED" "$OUT/engine_cuda.log" | head -8
echo "=== sim --device cuda 0..48"
timeout 130 "$G/bin/tierkv" sim --device cuda --seeds 0..48 --jobs 16 --no-shrink --keep-going --out-dir "$OUT" > "$OUT/sim.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/sim.log" | grep -E "seeds run|fail|wall time|coverage" | tail -5
PY=/tmp/tierkv-py; rm -rf "$PY"; mkdir -p "$PY"
python3 -m zipfile -e "$G"/wheels/tierkv-*.whl "$PY"
export PYTHONPATH=$PY
echo "=== pytest: the GPU tests and the registered ops"
TIERKV_STORE_ITERATIONS=2000 timeout 120 python3 -m pytest -q -p no:cacheprovider python/tests/test_cuda_ops.py python/tests/test_torch_ops.py python/tests/test_cuda.py -rs > "$OUT/pytest.log" 2>&1; echo "rc=$?"
grep -E "passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -8
unset PYTHONPATH
for run in new old new2 old2; do
  bin=$G/bin/tierkv; case $run in old*) bin=$G/bin/tierkv-old;; esac
  echo "=== replay --device cuda 61 layers ($run)"
  timeout 55 "$bin" replay --device cuda --trace "$G/data/trace.jsonl" --requests 60 --layers 61 --time-scale 5 > "$OUT/replay-61-$run.log" 2>&1; echo "rc=$?"
  grep -E "^finished|step latency|computing steps" "$OUT/replay-61-$run.log" | head -4
done
