"""tierkv.HostTier on a GPU (skipped without a CUDA build of tierkv, torch or a GPU): random
block mappings both ways against a pure-torch reference; a job of more copy-kernel slices than
the driver has pinned copy lists, behind a busy stream; a store issued right after a kernel
wrote its blocks on the current stream (vllm#45704's pattern), clean with the event and caught
without it; and the refusals of mixed or foreign memory."""

import os

import numpy as np
import pytest

import tierkv

torch = pytest.importorskip("torch")
if "cuda" not in tierkv.BACKENDS or not torch.cuda.is_available():
    pytest.skip("needs tierkv built with --features cuda, and a GPU", allow_module_level=True)

KV = 64 * 656
IK = 64 * 132
FORMATS = ["kv/fp8_packed", "index_k/fp8"]
GROUPS = [(64, [(0, KV)]), (64, [(1, IK)])]


def caches(blocks, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randint(-128, 128, (blocks, KV), dtype=torch.int8, device="cuda", generator=g)
    ik = torch.randint(-128, 128, (blocks, IK), dtype=torch.int8, device="cuda", generator=g)
    return kv, ik


def pointers(tensors, block_ids):
    """vLLM's DevicePointers for two one-layer groups with the same blocks."""
    ptrs, sizes = [], []
    for t, page in zip(tensors, (KV, IK)):
        for b in block_ids:
            ptrs.append(t.data_ptr() + int(b) * t.stride(0))
            sizes.append(page)
    return np.array(ptrs, np.uint64).tobytes(), np.array(sizes, np.uint64).tobytes()


def stream():
    return torch.cuda.current_stream().cuda_stream


def drain(tier, ids):
    tier.wait(list(ids))
    done = tier.get_finished()
    assert sorted(j for j, *_ in done) == sorted(ids), done
    assert all(ok for _, ok, _, _ in done), done
    return done


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_random_mappings_both_ways_match_a_torch_reference(blocks_per_chunk):
    rng = np.random.default_rng(blocks_per_chunk)
    blocks, chunks = 128, 64
    kv, ik = caches(blocks, 1)
    tier = tierkv.HostTier([kv, ik], GROUPS, FORMATS, blocks_per_chunk, chunks)
    assert tier.backend == "cuda"
    # The copy kernel compiled at registration: batches of small copies are one launch.
    assert tier.copy_path == "kernel", tier.copy_path
    host = [torch.zeros((chunks * blocks_per_chunk, KV), dtype=torch.int8), torch.zeros((chunks * blocks_per_chunk, IK), dtype=torch.int8)]
    for job in range(60):
        # Up to 40 scattered blocks: jobs of fewer than 16 page copies go to the copy engines,
        # larger ones to the copy kernel (KERNEL_COPIES_MIN in the CUDA driver).
        n = int(rng.integers(1, 41))
        skip = int(rng.integers(0, blocks_per_chunk))
        n_chunks = -(-(n + skip) // blocks_per_chunk)
        chunk_ids = rng.choice(chunks, size=n_chunks, replace=False).astype(np.uint64)
        block_ids = rng.choice(blocks, size=n, replace=False)
        slots = [int(chunk_ids[(skip + j) // blocks_per_chunk]) * blocks_per_chunk + (skip + j) % blocks_per_chunk for j in range(n)]
        ptrs, sizes = pointers((kv, ik), block_ids)
        both = np.concatenate([chunk_ids, chunk_ids]).tobytes()
        before = (kv.clone(), ik.clone())
        store = job % 2 == 0
        (tier.store if store else tier.load)(job, ptrs, sizes, [n, n], [1, 1], [skip, skip], both, stream=stream())
        drain(tier, [job])
        for t, (dev, ref) in enumerate(zip((kv, ik), before)):
            for j, b in enumerate(block_ids):
                if store:
                    host[t][slots[j]] = ref[b].cpu()
                else:
                    ref[b] = host[t][slots[j]].cuda()
            assert torch.equal(dev, ref), f"job {job} cache {t}"
        for c in range(chunks):
            for t in range(2):
                got = torch.frombuffer(bytearray(tier.read_host(t, c)), dtype=torch.int8)
                want = host[t][c * blocks_per_chunk:(c + 1) * blocks_per_chunk].reshape(-1)
                assert torch.equal(got, want), f"job {job} chunk {c} cache {t}"


def test_a_job_of_more_slices_than_copy_lists_round_trips_behind_a_busy_stream():
    """A store and a load of 36,000 scattered blocks (72,000 page copies: five slices of the
    copy kernel, more than the driver's four pinned copy lists), each issued behind about a
    millisecond of GPU work and a write on the current stream: the fifth slice's list reuses
    the first's buffer while that upload may still wait behind the work. The bytes round-trip."""
    blocks = 36_000
    kv, ik = caches(blocks, 3)
    want = (kv.clone(), ik.clone())
    tier = tierkv.HostTier([kv, ik], GROUPS, FORMATS, 1, blocks)
    order = np.arange(blocks)[::-1]  # reversed: no two pages coalesce
    ptrs, sizes = pointers((kv, ik), order)
    chunks = np.concatenate([np.arange(blocks), np.arange(blocks)]).astype(np.uint64).tobytes()
    torch.cuda._sleep(2_000_000)
    kv.copy_(want[0])
    ik.copy_(want[1])
    tier.store(0, ptrs, sizes, [blocks, blocks], [1, 1], [0, 0], chunks, stream=stream())
    drain(tier, [0])
    for c in (0, 1, blocks // 2, blocks - 1):
        got = np.frombuffer(tier.read_host(0, c), np.int8)
        assert np.array_equal(got, want[0][order[c]].cpu().numpy()), c
    torch.cuda._sleep(2_000_000)
    kv.zero_()
    ik.zero_()
    tier.load(1, ptrs, sizes, [blocks, blocks], [1, 1], [0, 0], chunks, stream=stream())
    drain(tier, [1])
    assert torch.equal(kv, want[0]) and torch.equal(ik, want[1])


def store_right_after_a_write(mutant, iterations, scattered):
    """A kernel on the current stream writes a block's bytes; the store is issued at once.
    Returns how many stores read bytes other than the kernel's. `scattered`: the blocks in
    reverse order, so no two pages coalesce (16 page copies: the copy kernel); else in order
    (one run per cache: the copy engines)."""
    blocks = 8
    kv, ik = caches(blocks, 2)
    tier = tierkv.HostTier([kv, ik], GROUPS, FORMATS, 1, blocks, mutant=mutant)
    ptrs, sizes = pointers((kv, ik), range(blocks)[::-1] if scattered else range(blocks))
    chunks = np.concatenate([np.arange(blocks), np.arange(blocks)]).astype(np.uint64).tobytes()
    corrupt = 0
    for i in range(iterations):
        value = (i % 250) - 125
        # Keep the current stream busy (about a millisecond: longer than the store takes to be
        # queued on either path, so a store that does not wait reads the old bytes), then write
        # every block: the store must wait.
        torch.cuda._sleep(2_000_000)
        kv.fill_(value)
        ik.fill_(value)
        tier.store(i, ptrs, sizes, [blocks, blocks], [1, 1], [0, 0], chunks, stream=stream())
        tier.wait([i])
        (done,) = tier.get_finished()
        assert done[0] == i and done[1]
        for t in (0, 1):
            got = np.frombuffer(tier.read_host(t, blocks - 1), np.int8)
            corrupt += int((got != value).any())
    return corrupt


@pytest.mark.parametrize("scattered", [False, True])
def test_a_store_issued_right_after_a_kernel_reads_what_the_kernel_wrote(scattered):
    iterations = int(os.environ.get("TIERKV_STORE_ITERATIONS", "10000"))
    assert store_right_after_a_write(None, iterations, scattered) == 0


@pytest.mark.parametrize("scattered", [False, True])
def test_without_the_event_the_same_store_reads_stale_bytes(scattered):
    assert store_right_after_a_write("store-without-event", 200, scattered) > 0


def test_mixed_memory_and_unknown_mutants_are_refused():
    kv, _ = caches(4, 3)
    ik = np.zeros((4, IK), np.int8)
    with pytest.raises(tierkv.RegisterError, match="one kind of memory"):
        tierkv.HostTier([kv, ik], GROUPS, FORMATS, 1, 4)
    with pytest.raises(tierkv.RegisterError, match="unknown mutant"):
        tierkv.HostTier([kv, torch.zeros((4, IK), dtype=torch.int8, device="cuda")], GROUPS, FORMATS, 1, 4, mutant="x")
