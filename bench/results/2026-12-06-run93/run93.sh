#!/usr/bin/env bash
# Run 93 (kernels/GPU.md): issue 30's GPU items at the commit that resolves it (after the
# argument records' review fixes and zoo mutant 45): kernel conformance, `engine_it cuda_device`,
# `tierkv sim --device cuda` over 48 seeds and the GPU pytests (`run93.sh gpu`); then 2,000
# default seeds on the machine's CPU cores with the staged `tierkv` (`run93.sh campaign`).
# Staged by bench/stage.sh, the CUDA wheel in .gpu/wheels. Run from the checkout, .gpu/ beside it.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${1:-gpu}" = gpu ]; then
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "=== kernel conformance"
timeout 90 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" "$OUT/conformance.log" | head -24
echo "=== engine_it cuda_device"
timeout 60 "$G/bin/engine_it" cuda_device --test-threads 1 > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
grep -E "^test |test result|panicked|FAILED" "$OUT/engine_cuda.log" | head -8
echo "=== sim --device cuda 0..48"
timeout 150 "$G/bin/tierkv" sim --device cuda --seeds 0..48 --jobs 16 --no-shrink --keep-going > "$OUT/sim.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/sim.log" | grep -vE "^progress" | tail -8
PY=/tmp/tierkv-py; rm -rf "$PY"; mkdir -p "$PY"
python3 -m zipfile -e "$G"/wheels/tierkv-*.whl "$PY"
export PYTHONPATH=$PY
echo "=== pytest: the GPU tests and the registered ops"
TIERKV_STORE_ITERATIONS=2000 timeout 150 python3 -m pytest -q -p no:cacheprovider python/tests/test_cuda_ops.py python/tests/test_torch_ops.py python/tests/test_cuda.py -rs > "$OUT/pytest.log" 2>&1; echo "rc=$?"
grep -E "passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -8
else
nproc | tee "$OUT/cpus.txt"
echo "=== default profile, seeds 0..2000"
timeout 560 "$G/bin/tierkv" sim --seeds 0..2000 --jobs 16 --keep-going --no-shrink --coverage > "$OUT/default2000.log" 2>&1; echo "rc=$?"
tr '\r' '\n' < "$OUT/default2000.log" | grep -vE "^progress" | tail -130
fi
