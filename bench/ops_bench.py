"""tierkv.ops called from Python, timed on the shapes `tierkv bench` times its kernels on.

    python3 bench/ops_bench.py OUT.jsonl

Each line of OUT is {"name": ..., "ms": median milliseconds over 10 timed calls}, under the
names `bench/torch_bench.py` uses, so that `tierkv bench --torch-json OUT` prints these beside
the kernels it launches itself (its "torch" column then holds tierkv.ops' times: the same
kernels plus the guard kernel, two events and the Python call). Lines with "what" are the ops'
fixed cost per call: host time of a call, and GPU time per call of a tiny op; and each op's
time per call with 8 calls queued back to back, and with 8 calls replayed from a CUDA graph.
Needs a CUDA build of tierkv (PYTHONPATH to the unzipped wheel), torch and a GPU.
"""
import json
import sys
import time

import torch

import tierkv
from tierkv import ops

dev = "cuda"
REPS = 10
out = open(sys.argv[1] if len(sys.argv) > 1 else "/dev/null", "w")


def median_ms(run, per=1):
    """Median milliseconds of `run` over REPS timed calls (after 3 untimed), divided by `per`."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    ts = []
    for _ in range(REPS):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / per)
    ts.sort()
    return ts[len(ts) // 2]


def timeit(f):
    return median_ms(f)


def queued(f, n=8):
    """Per call, n calls queued back to back (the GPU's time per call once the host is ahead)."""
    def batch():
        for _ in range(n):
            f()

    return median_ms(batch, n)


def graphed(f, n=8):
    """Per call, n calls captured once in a torch CUDA graph and replayed (no host work per
    call: the GPU's own time per call, as in a server that replays its decode step)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            f()
    ms = median_ms(graph.replay, n)
    del graph
    return ms


def emit(name, ms, f=None):
    out.write(json.dumps({"name": name, "ms": ms}) + "\n")
    out.flush()
    line = f"tierkv.ops {name}: {ms:.3f} ms"
    if f is not None:
        q = queued(f)
        out.write(json.dumps({"what": f"{name}, 8 queued back to back", "ms_per_call": q}) + "\n")
        line += f"; 8 queued back to back: {q:.4f} ms per call"
        gr = graphed(f)
        out.write(json.dumps({"what": f"{name}, 8 replayed from a CUDA graph", "ms_per_call": gr}) + "\n")
        line += f"; 8 replayed from a CUDA graph: {gr:.4f} ms per call"
    print(line, flush=True)


def record(**kw):
    out.write(json.dumps(kw) + "\n")
    out.flush()
    print(json.dumps(kw), flush=True)


g = torch.Generator(device=dev).manual_seed(1)

# index_k_store, 1M tokens into a pool of exactly those slots (tierkv bench's shape).
n = 1 << 20
keys = ((torch.rand(n, 128, device=dev, generator=g) * 8) - 4).bfloat16()
gamma = torch.ones(128, device=dev)
beta = torch.zeros(128, device=dev)
ang = torch.rand(n, 32, device=dev, generator=g) * 6.28
rope = torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()
slots = torch.arange(n, dtype=torch.int32, device=dev)
for dtype, page in (("fp8", 64 * 132), ("bf16", 64 * 256)):
    pool = torch.empty(n // 64, page, dtype=torch.uint8, device=dev)
    f = lambda: ops.index_k_store(keys, pool, slots, gamma, beta, rope, dtype=dtype)  # noqa: E731
    emit(f"index_k_store {dtype}", timeit(f), f)
    del pool
del keys, rope, ang, slots

# paged_mqa_logits: 64 rows x 64K context, 64 heads, every page its own (tierkv bench's shape).
B, C, H = 64, 65536, 64
P = C // 64
table = torch.randperm(B * P, device=dev, generator=g).int().view(B, P)
lens = torch.full((B,), C, dtype=torch.int32, device=dev)
q = torch.randint(0, 256, (B, H, 128), dtype=torch.uint8, device=dev, generator=g)
q[(q & 0x7F) == 0x7F] = 0
w = torch.rand(B, H, device=dev, generator=g) * 0.01
logits = None
for dtype, page in (("fp8", 64 * 132), ("bf16", 64 * 256)):
    cache = torch.randint(0, 256, (B * P, page), dtype=torch.uint8, device=dev, generator=g)
    if dtype == "fp8":
        cache[:, :8192][(cache[:, :8192] & 0x7F) == 0x7F] = 0
        cache[:, 8192:] = (torch.rand(B * P, 64, device=dev, generator=g) + 0.5).view(torch.uint8).view(B * P, 256)
    else:
        cache.copy_(torch.randn(B * P, page // 2, device=dev, generator=g).bfloat16().view(torch.uint8))
    f = lambda: ops.paged_mqa_logits(q, cache, w, lens, table, C, dtype=dtype)  # noqa: E731
    emit(f"index_logits {dtype}", timeit(f), f)
    if dtype == "fp8":
        logits = ops.paged_mqa_logits(q, cache, w, lens, table, C, dtype=dtype)
    del cache

for k in (512, 2048):
    f = lambda: ops.topk(logits, lens, k)  # noqa: E731
    emit(f"topk {k}", timeit(f), f)
row, row_len = logits[:1].contiguous(), lens[:1].contiguous()
f = lambda: ops.topk(row, row_len, 2048)  # noqa: E731
emit("topk 2048 batch1", timeit(f), f)

# The fixed cost of a call: a top-k of one 64-position row, 1,000 times.
tiny, tiny_len = logits[:1, :64].contiguous(), torch.full((1,), 64, dtype=torch.int32, device=dev)
tiny_out = torch.empty(1, 8, dtype=torch.int32, device=dev)
for _ in range(100):
    ops.topk(tiny, tiny_len, 8, out=tiny_out)
torch.cuda.synchronize()
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record()
t0 = time.perf_counter()
for _ in range(1000):
    ops.topk(tiny, tiny_len, 8, out=tiny_out)
host_us = (time.perf_counter() - t0) * 1e3
b.record()
b.synchronize()
record(what="host time per call (topk, 1 x 64, k=8)", us=host_us)
record(what="GPU time per call, back to back (topk, 1 x 64, k=8)", us=a.elapsed_time(b))
ops.check()
