#!/usr/bin/env bash
# Run 99, second call (kernels/GPU.md): what the first call's file limit kept back (conformance,
# the GPU pytest, ops_bench of the new wheel), then issue 35's replays and the other GPU checks.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=/tmp/logs; mkdir -p $L
echo "=== kernel conformance"
timeout 90 "$G/bin/kernels_it" cuda --test-threads 1 > $L/conformance.log 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" $L/conformance.log | head -4
py=/tmp/tierkv-new; rm -rf "$py"; mkdir -p "$py"; python3 -m zipfile -e "$G"/wheels/new/tierkv-*.whl "$py"; export PYTHONPATH=$py
echo "=== pytest (new wheel)"
TIERKV_STORE_ITERATIONS=10000 timeout 150 python3 -m pytest -q -p no:cacheprovider python/tests/test_cuda_ops.py python/tests/test_torch_ops.py python/tests/test_cuda.py -rs > $L/pytest.log 2>&1; echo "rc=$?"
grep -E "passed|failed|FAILED|Error" $L/pytest.log | tail -12
echo "=== ops_bench (new)"
timeout 90 python3 bench/ops_bench.py "$OUT/ops-new.jsonl" > $L/ops.log 2>&1; echo "rc=$?"
grep -E "tierkv.ops" $L/ops.log | head -12
unset PYTHONPATH
echo "=== engine_it cuda_device"
timeout 90 "$G/bin/engine_it" cuda_device --test-threads 1 > $L/engine.log 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" $L/engine.log | head -4
run() { # NAME LAYERS REQUESTS ARGS...
  local name=$1 layers=$2 req=$3; shift 3
  echo "=== replay $name"
  timeout 100 "$G/bin/tierkv" replay --device cuda --trace "$G/data/trace.jsonl" --requests $req --layers $layers --time-scale 5 --overlap "$@" > $L/r.log 2>&1
  echo "rc=$?"
  grep -E "^finished|computing steps|device ms per step|kernel launches" $L/r.log | cut -c1-400
}
run 61-untimed-1 61 60 --no-device-timing
run 61-untimed-2 61 60 --no-device-timing
run 61-timed 61 60
run 4-untimed 4 120 --no-device-timing
run 4-timed 4 120
echo "=== sim --device cuda 0..48"
timeout 110 "$G/bin/tierkv" sim --device cuda --seeds 0..48 --jobs 16 --no-shrink --keep-going > $L/sim.log 2>&1; echo "rc=$?"
tr '\r' '\n' < $L/sim.log | grep -vE "^progress" | grep -E "seeds run|failing|finding|FAIL" | head -6
CS=/usr/local/cuda/bin/compute-sanitizer
t0=$SECONDS
timeout 90 $CS --tool racecheck --error-exitcode 86 --print-limit 20 "$G/bin/kernels_it" topk --test-threads 1 > $L/racecheck.log 2>&1
echo "racecheck topk: rc=$? in $((SECONDS - t0)) s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $L/racecheck.log | tail -1); $(grep -cE '^test .* ok$' $L/racecheck.log) tests ok"
tar czf "$OUT/logs.tgz" -C $L .
