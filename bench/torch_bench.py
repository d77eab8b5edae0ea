"""PyTorch implementations of the operations `tierkv bench` times, on the same GPU, same sizes.

    python3 bench/torch_bench.py OUT.jsonl

Each line of OUT is {"name": ..., "ms": median milliseconds}. `tierkv bench --torch-json OUT`
puts them beside tierkv's own numbers. These are straightforward PyTorch formulations (what an
engine without custom kernels would run), not tuned kernels.
"""
import json
import sys

import torch

dev = "cuda"
REPS = 10


def timeit(f):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(REPS):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


out = open(sys.argv[1], "w")


def emit(name, ms):
    out.write(json.dumps({"name": name, "ms": ms}) + "\n")
    out.flush()
    print(f"torch {name}: {ms:.3f} ms", flush=True)


def hadamard(n):
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dev)


# Device copy (the ceiling): 2 GiB.
x = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
y = torch.empty_like(x)
emit("device copy", timeit(lambda: y.copy_(x)))
del x, y

# index_k_store, 1M tokens: LayerNorm -> NeoX RoPE on dims 0..64 -> Hadamard -> fp8 or bf16 -> scatter.
n = 1 << 20
g = torch.Generator(device=dev).manual_seed(1)
keys = ((torch.rand(n, 128, device=dev, generator=g) * 8) - 4).bfloat16()
pos = torch.arange(n, device=dev) % 131072
inv = 10000.0 ** (-torch.arange(0, 32, device=dev, dtype=torch.float64) * 2 / 64)
ang = pos[:, None].double() * inv[None, :]
cos, sin = ang.cos().float(), ang.sin().float()
H = hadamard(128)
gamma = torch.ones(128, device=dev)
beta = torch.zeros(128, device=dev)
slots = torch.arange(n, device=dev)
pages, t = slots // 64, slots % 64
P = n // 64


def transform():
    xf = torch.nn.functional.layer_norm(keys.float(), (128,), gamma, beta, 1e-6)
    a, b = xf[:, :32], xf[:, 32:64]
    r = torch.cat([a * cos - b * sin, b * cos + a * sin, xf[:, 64:]], dim=1)
    return r @ H


pool8 = torch.empty(P, 8448, dtype=torch.uint8, device=dev)
vals8 = pool8[:, :8192].unflatten(1, (64, 128))
scales8 = pool8[:, 8192:].view(torch.float32)


def store_fp8():
    yv = transform()
    scale = yv.abs().amax(dim=1, keepdim=True).clamp(min=1e-4) / 448.0
    q = (yv / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    vals8[pages, t] = q
    scales8[pages, t] = scale.squeeze(1)


emit("index_k_store fp8", timeit(store_fp8))
pool16 = torch.empty(P, 16384, dtype=torch.uint8, device=dev)
vals16 = pool16.view(torch.bfloat16).unflatten(1, (64, 128))


def store_bf16():
    vals16[pages, t] = transform().bfloat16()


emit("index_k_store bf16", timeit(store_bf16))
del keys, cos, sin, pool8, pool16, vals8, vals16, scales8

# index_logits: batch 64 x 64K context, 64 heads, paged (page table -> gather), fp32 math.
B, C, Hh = 64, 65536, 64
PT = C // 64
page_table = torch.arange(B * PT, device=dev).view(B, PT)
q = (torch.rand(B, Hh, 128, device=dev, generator=g) * 400 - 200).to(torch.float8_e4m3fn).float()
w = torch.rand(B, Hh, device=dev, generator=g) * 0.01
kpool8 = (torch.rand(B * PT, 64, 128, device=dev, generator=g) * 800 - 400).to(torch.float8_e4m3fn)
kscale = torch.rand(B * PT, 64, device=dev, generator=g)


def logits_fp8():
    k = kpool8[page_table].view(B, C, 128).float()
    s = torch.einsum("bhd,bnd->bhn", q, k).relu_()
    return torch.einsum("bh,bhn->bn", w, s) * kscale[page_table].view(B, C)


emit("index_logits fp8", timeit(logits_fp8))
logits = logits_fp8()
del kpool8
kpool16 = (torch.rand(B * PT, 64, 128, device=dev, generator=g) * 2 - 1).bfloat16()


def logits_bf16():
    k = kpool16[page_table].view(B, C, 128).float()
    s = torch.einsum("bhd,bnd->bhn", q, k).relu_()
    return torch.einsum("bh,bhn->bn", w, s)


emit("index_logits bf16", timeit(logits_bf16))
del kpool16

for kk in (512, 2048):
    emit(f"topk {kk}", timeit(lambda: torch.topk(logits, kk, dim=-1)))
# Batch 1: one row of 64K (a decode step of one request).
row = logits[:1]
emit("topk 2048 batch1", timeit(lambda: torch.topk(row, 2048, dim=-1)))

# Page transfers of one 128K-token layer (2048 pages of KV 41984 B + index-K 8448 B), scattered
# host pages: gather on the host, one copy (what a PyTorch engine does with index_select).
perm = torch.randperm(4096)[:2048]
hosts = [torch.empty(4096, pb, dtype=torch.uint8).pin_memory() for pb in (41984, 8448)]
devs = [torch.empty(2048, pb, dtype=torch.uint8, device=dev) for pb in (41984, 8448)]


def h2d():
    for h, d in zip(hosts, devs):
        d.copy_(h.index_select(0, perm), non_blocking=True)


def d2h():
    for h, d in zip(hosts, devs):
        h.index_copy_(0, perm, d.cpu())


emit("page transfer scattered h2d", timeit(h2d))
emit("page transfer scattered d2h", timeit(d2h))
print("torch", torch.__version__, torch.cuda.get_device_name())
