#!/usr/bin/env bash
# Run 99 (kernels/GPU.md): issue 32's two open figures after `791aa8c` (top-k over positions
# checks its lengths in its own kernel, no guard kernel; a host-tier job's copies go to the
# driver in growing batches as they are listed), against the CUDA wheel of `5d30a70` (before);
# and issue 35's replays on this machine. Staged by bench/stage.sh; .gpu/wheels/new and
# .gpu/wheels/old hold the two CUDA wheels (`maturin build --release --features cuda`).
#   bash run99.sh a   conformance, the GPU pytest, ops_bench and offload_bench of both wheels
#                     (alternated), `tierkv bench` beside the new ops
#   bash run99.sh b   engine_it cuda_device, replays at 61 and 4 layers, racecheck over top-k,
#                     sim --device cuda
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
part=${1:-a}
wheel() { # NAME: unpack .gpu/wheels/NAME and put it on PYTHONPATH
  local py=/tmp/tierkv-$1; rm -rf "$py"; mkdir -p "$py"
  python3 -m zipfile -e "$G"/wheels/$1/tierkv-*.whl "$py"
  export PYTHONPATH=$py
}
summary() { # JSONL
python3 - "$1" <<'PY'
import json, sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("what") in ("tier", "one pinned copy"):
        rows[(r["what"], r["direction"], r["blocks"], r["layout"])].append(
            (round(r["gbps"], 1), round(r.get("submit_ms", 0), 2), round(r.get("gpu_ms", 0), 2), round(r["wall_ms"], 2)))
for k, v in sorted(rows.items()):
    print(k, "(GB/s, submit ms, gpu ms, wall ms)", v)
PY
}
if [ "$part" = a ]; then
  echo "=== kernel conformance"
  timeout 90 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"
  grep -E "test result|panicked|FAILED" "$OUT/conformance.log" | head -4
  wheel new
  python3 -c "import tierkv, torch; print(tierkv.__version__, tierkv.BACKENDS, torch.__version__, torch.cuda.get_device_name())"
  echo "=== pytest: the GPU tests (10,000 stores right after a kernel, each path), the registered ops"
  TIERKV_STORE_ITERATIONS=10000 timeout 150 python3 -m pytest -q -p no:cacheprovider python/tests/test_cuda_ops.py python/tests/test_torch_ops.py python/tests/test_cuda.py -rs > "$OUT/pytest.log" 2>&1; echo "rc=$?"
  grep -E "passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -12
  for w in new old new2; do
    wheel ${w%2}
    echo "=== ops_bench ($w)"
    timeout 90 python3 bench/ops_bench.py "$OUT/ops-$w.jsonl" > "$OUT/ops-$w.log" 2>&1; echo "rc=$?"
    grep -E "topk" "$OUT/ops-$w.log" | head -8
  done
  for w in new old new2; do
    wheel ${w%2}
    echo "=== offload_bench ($w)"
    timeout 100 python3 bench/offload_bench.py "$OUT/offload-$w.jsonl" > "$OUT/offload-$w.log" 2>&1; echo "rc=$?"
    summary "$OUT/offload-$w.jsonl" | grep -E "random|pinned.*1000, 'contiguous'|'tier', '(store|load)', 1000, 'contiguous'"
  done
  unset PYTHONPATH
  echo "=== tierkv bench beside the new ops (5 reps)"
  timeout 90 "$G/bin/tierkv" bench --reps 5 --torch-json "$OUT/ops-new.jsonl" --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1; echo "rc=$?"
  grep -iE "topk|index_k_store|index_logits tensor" "$OUT/bench.md" | head -20
fi
if [ "$part" = b ]; then
  run() { # NAME LAYERS REQUESTS ARGS...
    local name=$1 layers=$2 req=$3; shift 3
    echo "=== $name"
    timeout 120 "$G/bin/tierkv" replay --device cuda --trace "$G/data/trace.jsonl" --requests $req --layers $layers --time-scale 5 --overlap "$@" > "$OUT/replay-$name.log" 2>&1
    echo "rc=$?"
    grep -E "^finished|computing steps|device ms per step|kernel launches" "$OUT/replay-$name.log" | cut -c1-400
  }
  echo "=== engine_it cuda_device"
  timeout 90 "$G/bin/engine_it" cuda_device --test-threads 1 > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"
  grep -E "test result|panicked|FAILED" "$OUT/engine_cuda.log" | head -4
  run 61-untimed-1 61 60 --no-device-timing
  run 61-untimed-2 61 60 --no-device-timing
  run 61-timed 61 60
  run 4-untimed 4 120 --no-device-timing
  run 4-timed 4 120
  CS=/usr/local/cuda/bin/compute-sanitizer
  t0=$SECONDS
  timeout 100 $CS --tool racecheck --error-exitcode 86 --print-limit 20 "$G/bin/kernels_it" topk --test-threads 1 > "$OUT/sanitize-racecheck-topk.log" 2>&1
  echo "racecheck topk: rc=$? in $((SECONDS - t0)) s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-racecheck-topk.log" | tail -1); $(grep -cE '^test .* ok$' "$OUT/sanitize-racecheck-topk.log") tests ok"
  echo "=== sim --device cuda 0..48"
  timeout 120 "$G/bin/tierkv" sim --device cuda --seeds 0..48 --jobs 16 --no-shrink --keep-going > "$OUT/sim.log" 2>&1; echo "rc=$?"
  tr '\r' '\n' < "$OUT/sim.log" | grep -vE "^progress" | grep -E "seeds run|failing|finding|FAIL" | head -6
fi
