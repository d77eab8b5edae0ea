#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_INCLUDE_DIR=/usr/local/cuda/include CUDA_HOME=/usr/local/cuda
export PATH=/usr/local/cuda/bin:$PATH
G=.gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "=== harness"
timeout 150 $G/h/harness > "$OUT/harness.txt" 2>&1; echo "rc=$?"; grep -E "^---|rows  1 len  65536 k 2048 C 4|rows 64 len  65536 k 2048 C 2|MISMATCH|differ" "$OUT/harness.txt" | grep -v "^v2p" | cut -c1-200
echo "=== kernel conformance"
timeout 120 "$G/bin/kernels_it" cuda --test-threads 1 > "$OUT/conformance.log" 2>&1; echo "rc=$?"; grep -E "test result|panicked|FAILED" "$OUT/conformance.log"
echo "=== torch bench"
timeout 150 python3 "$G/torch_bench.py" "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1; echo "rc=$?"
echo "=== tierkv bench"
timeout 200 "$G/bin/tierkv" bench --torch-json "$OUT/torch.jsonl" --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1; echo "rc=$?"; grep -E "device copy 2|wgmma.*64 x 64K|topk|^\| (1|64) x|^\| fp8 \| wgmma" "$OUT/bench.md" | cut -c1-200
echo "=== engine cuda_device"
timeout 100 "$G/bin/engine_it" cuda_device --test-threads 1 > "$OUT/engine_cuda.log" 2>&1; echo "rc=$?"; grep -E "test result|panicked" "$OUT/engine_cuda.log"
echo "=== memcheck harness quick"
timeout 120 compute-sanitizer --tool memcheck $G/h/harness quick > "$OUT/memcheck.txt" 2>&1; echo "rc=$?"; grep -E "ERROR SUMMARY|MISMATCH" "$OUT/memcheck.txt" | sort | uniq -c
echo "=== ncu fp8 wgmma"
timeout 150 ncu --kernel-name index_logits_wgmma_fp8 --launch-skip 4 --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis "$G/bin/tierkv" bench --reps 1 > "$OUT/ncu.txt" 2>&1; echo "rc=$?"; grep -E "Throughput|Pipe|Stall|Issue|Busy|Duration|Executed Ipc" "$OUT/ncu.txt" | head -40
