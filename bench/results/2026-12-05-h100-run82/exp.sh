set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=/tmp/tierkv-py; rm -rf "$PY"; mkdir -p "$PY"
python3 -m zipfile -e .gpu/wheels/tierkv-*.whl "$PY"
export PYTHONPATH=$PY
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 python3 .gpu/offload_bench.py "$OUT/offload-exp.jsonl" > "$OUT/offload-exp.log" 2>&1; echo rc=$?
grep -E "EXPERIMENT" "$OUT/offload-exp.log" | head -8
grep -c EXPERIMENT "$OUT/offload-exp.log"
