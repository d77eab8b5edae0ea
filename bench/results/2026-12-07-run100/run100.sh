#!/usr/bin/env bash
# Run 100 (kernels/GPU.md): issue 32's GPU paths changed after run 99 (`791aa8c`), at the final
# commit: the copy kernel compiled when the worker registers its caches (`CudaDriver::copies_on`),
# the pinned copy lists grown as needed up to 32, the top-k length test with -1, and
# `HostTier.copy_path` (the kernel, or why the copy engines). Staged by
# bench/stage.sh; .gpu/wheels/new holds the CUDA wheel (`maturin build --release --features cuda`).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "=== kernel conformance"
timeout 90 "$G/bin/kernels_it" cuda --test-threads 1 > $L/conformance.log 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" $L/conformance.log | head -4
py=/tmp/tierkv-new; rm -rf "$py"; mkdir -p "$py"; python3 -m zipfile -e "$G"/wheels/new/tierkv-*.whl "$py"; export PYTHONPATH=$py
python3 -c "import tierkv, torch; print(tierkv.__version__, tierkv.BACKENDS, torch.__version__, torch.cuda.get_device_name())"
echo "=== pytest (new wheel)"
TIERKV_STORE_ITERATIONS=10000 timeout 150 python3 -m pytest -q -p no:cacheprovider python/tests/test_cuda_ops.py python/tests/test_torch_ops.py python/tests/test_cuda.py -rs > $L/pytest.log 2>&1; echo "rc=$?"
grep -E "passed|failed|FAILED|Error" $L/pytest.log | tail -12
summary() { # JSONL
python3 - "$1" <<'PY'
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
}
for i in 1 2; do
  echo "=== offload_bench $i"
  timeout 100 python3 bench/offload_bench.py "$OUT/offload-$i.jsonl" > $L/offload-$i.log 2>&1; echo "rc=$?"
  summary "$OUT/offload-$i.jsonl"
done
echo "=== ops_bench (new)"
timeout 90 python3 bench/ops_bench.py "$OUT/ops-new.jsonl" > $L/ops.log 2>&1; echo "rc=$?"
unset PYTHONPATH
echo "=== tierkv bench beside the ops (5 reps)"
timeout 90 "$G/bin/tierkv" bench --reps 5 --torch-json "$OUT/ops-new.jsonl" --out "$L/bench.md" > $L/bench.log 2>&1; echo "rc=$?"
grep -iE "topk|index_k_store|index_logits tensor" $L/bench.md | head -20
echo "=== engine_it cuda_device"
timeout 90 "$G/bin/engine_it" cuda_device --test-threads 1 > $L/engine.log 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" $L/engine.log | head -4
echo "=== sim --device cuda 0..48"
timeout 110 "$G/bin/tierkv" sim --device cuda --seeds 0..48 --jobs 16 --no-shrink --keep-going > $L/sim.log 2>&1; echo "rc=$?"
tr '\r' '\n' < $L/sim.log | grep -vE "^progress" | grep -E "seeds run|failing|finding|FAIL" | head -6
tar czf "$OUT/logs.tgz" -C $L .
