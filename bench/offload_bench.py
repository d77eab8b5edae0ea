"""The host tier's GPU transfers with DeepSeek-V3.2-shaped caches, against one pinned copy of the
same bytes (run on a GPU with tierkv built with --features cuda; prints JSON lines).

61 layers, each with its own MLA KV cache (64-token fp8 pages, 41,984 B) and index-K cache
(8,448 B); a job moves N blocks of every layer (one vLLM transfer_async): random blocks (no two
contiguous pages to coalesce, the worst case) and contiguous blocks (one run per cache)."""

import json
import sys
import time

import numpy as np
import torch

import tierkv

LAYERS, BLOCKS, CHUNKS = 61, 2048, 1024
KV, IK = 64 * 656, 64 * 132


def main(out):
    dev = torch.device("cuda", 0)
    caches = []
    for _ in range(LAYERS):
        caches.append(torch.randint(-128, 128, (BLOCKS, KV), dtype=torch.int8, device=dev))
        caches.append(torch.randint(-128, 128, (BLOCKS, IK), dtype=torch.int8, device=dev))
    groups = [(64, [(i, KV if i % 2 == 0 else IK) for i in range(2 * LAYERS)])]
    t0 = time.perf_counter()
    tier = tierkv.HostTier(caches, groups, ["kv/fp8_packed", "index_k/fp8"], 1, CHUNKS)
    setup = time.perf_counter() - t0
    stream = torch.cuda.current_stream().cuda_stream
    rec = lambda **kw: (print(json.dumps(kw)), out.write(json.dumps(kw) + "\n"))
    rec(what="setup", host_gib=tier.host_bytes / 2**30, seconds=setup, copy_path=tier.copy_path)
    rng = np.random.default_rng(0)
    job = 0
    for n in (1000, 100):
        for kind in ("random", "contiguous"):
            if kind == "random":
                ids = np.sort(rng.choice(BLOCKS // 2, size=n, replace=False)) * 2  # never adjacent
            else:
                ids = np.arange(n)
            ptrs = np.empty((2 * LAYERS, n), np.uint64)
            sizes = np.empty((2 * LAYERS, n), np.uint64)
            for i, c in enumerate(caches):
                ptrs[i] = c.data_ptr() + ids.astype(np.uint64) * np.uint64(c.stride(0))
                sizes[i] = c.shape[1]
            chunk_ids = np.arange(n, dtype=np.uint64).tobytes()
            p, s = ptrs.tobytes(), sizes.tobytes()
            for store in (True, False):
                for rep in range(3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    (tier.store if store else tier.load)(job, p, s, [n], [2 * LAYERS], [0], chunk_ids, stream=stream)
                    submitted = time.perf_counter()
                    tier.wait([job])
                    t1 = time.perf_counter()
                    (done,) = tier.get_finished()
                    assert done[0] == job and done[1], done
                    job += 1
                    rec(what="tier", direction="store" if store else "load", blocks=n, layout=kind, rep=rep,
                        bytes=done[2], submit_ms=(submitted - t0) * 1e3, wall_ms=(t1 - t0) * 1e3,
                        gpu_ms=done[3] * 1e3, gbps=done[2] / (t1 - t0) / 1e9)
            # One pinned copy of the same bytes.
            nbytes = n * LAYERS * (KV + IK)
            src = torch.empty(nbytes, dtype=torch.int8, device=dev)
            dst = torch.empty(nbytes, dtype=torch.int8).pin_memory()
            for store in (True, False):
                for rep in range(3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    (dst.copy_(src, non_blocking=True) if store else src.copy_(dst, non_blocking=True))
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    rec(what="one pinned copy", direction="store" if store else "load", blocks=n, layout=kind,
                        rep=rep, bytes=nbytes, wall_ms=(t1 - t0) * 1e3, gbps=nbytes / (t1 - t0) / 1e9)
            del src, dst


if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else "/dev/null", "w") as f:
        main(f)
