"""tierkv.HostTier with numpy caches: random block mappings both ways against a reference
written here (numpy slicing), and the refusals of registrations and jobs."""

import numpy as np
import pytest

import tierkv

KV = 64 * 656  # one 64-token page of fp8 MLA rows
IK = 64 * 132  # one 64-token page of fp8 index-K rows
FORMATS = ["kv/fp8_packed", "index_k/fp8"]


def caches(blocks: int, seed: int):
    rng = np.random.default_rng(seed)
    kv = rng.integers(-128, 128, size=(blocks, KV), dtype=np.int8)
    ik = rng.integers(-128, 128, size=(blocks, IK), dtype=np.int8)
    return kv, ik


def pointers(arrays, refs, block_ids):
    """vLLM's DevicePointers for one group: for each layer reference, for each block."""
    ptrs, sizes = [], []
    for tensor, ref_bytes in refs:
        a = arrays[tensor]
        base = a.__array_interface__["data"][0]
        for b in block_ids:
            ptrs.append(base + int(b) * a.strides[0])
            sizes.append(ref_bytes)
    return np.array(ptrs, dtype=np.uint64).tobytes(), np.array(sizes, dtype=np.uint64).tobytes()


@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 4])
def test_random_mappings_both_ways_leave_the_source_unchanged_and_the_destination_equal(blocks_per_chunk):
    rng = np.random.default_rng(blocks_per_chunk)
    blocks, chunks = 32, 16
    kv, ik = caches(blocks, 1)
    refs = [(0, KV), (1, IK)]
    tier = tierkv.HostTier([kv, ik], [(64, refs)], FORMATS, blocks_per_chunk, chunks)
    assert tier.host_bytes == chunks * blocks_per_chunk * (KV + IK)
    assert (tier.backend, tier.copy_path) == ("host", "host")
    # Reference host tier: per array, chunks of blocks_per_chunk pages.
    host = [np.zeros((chunks * blocks_per_chunk, KV), np.int8), np.zeros((chunks * blocks_per_chunk, IK), np.int8)]
    for job in range(40):
        n = int(rng.integers(1, 9))
        skip = int(rng.integers(0, blocks_per_chunk))
        n_chunks = -(-(n + skip) // blocks_per_chunk)
        chunk_ids = rng.choice(chunks, size=n_chunks, replace=False).astype(np.uint64)
        block_ids = rng.choice(blocks, size=n, replace=False)
        ptrs, sizes = pointers([kv, ik], refs, block_ids)
        slots = [int(chunk_ids[(skip + j) // blocks_per_chunk]) * blocks_per_chunk + (skip + j) % blocks_per_chunk for j in range(n)]
        store = job % 2 == 0
        before = [kv.copy(), ik.copy()]
        host_before = [h.copy() for h in host]
        call = tier.store if store else tier.load
        call(job, ptrs, sizes, [n], [2], [skip], chunk_ids.tobytes())
        for t, a in enumerate([kv, ik]):
            for j, b in enumerate(block_ids):
                if store:
                    host[t][slots[j]] = a[b]
                else:
                    before[t][b] = host[t][slots[j]]
            if store:
                np.testing.assert_array_equal(a, before[t])  # the source unchanged
            else:
                np.testing.assert_array_equal(a, before[t])  # the destination equal to the reference
                np.testing.assert_array_equal(host[t], host_before[t])
        for c in range(chunks):
            for t in range(2):
                got = np.frombuffer(tier.read_host(t, c), dtype=np.int8)
                want = host[t][c * blocks_per_chunk:(c + 1) * blocks_per_chunk].reshape(-1)
                np.testing.assert_array_equal(got, want, err_msg=f"job {job} chunk {c} cache {t}")
        (done,) = tier.get_finished()
        assert done[0] == job and done[1] is True and done[2] == n * (KV + IK)
    pages, runs = tier.copies
    assert runs <= pages


def test_contiguous_blocks_into_consecutive_slots_are_one_run_each():
    kv, ik = caches(8, 2)
    tier = tierkv.HostTier([kv, ik], [(64, [(0, KV), (1, IK)])], FORMATS, 4, 2)
    ptrs, sizes = pointers([kv, ik], [(0, KV), (1, IK)], [2, 3, 4, 5])
    tier.store(7, ptrs, sizes, [4], [2], [0], np.array([1], np.uint64).tobytes())
    assert tier.copies == (8, 2)


def test_a_bf16_index_k_behind_an_fp8_configuration_is_refused_naming_the_group():
    kv = np.zeros((4, KV), np.int8)
    ik_bf16 = np.zeros((4, 64 * 256), np.int8)
    with pytest.raises(tierkv.RegisterError, match=r"group 1, layer reference 0: 16384 bytes per page.*8448"):
        tierkv.HostTier([kv, ik_bf16], [(64, [(0, KV)]), (64, [(1, 64 * 256)])], FORMATS, 1, 4)


def test_bad_registrations_are_refused():
    kv = np.zeros((4, KV), np.int8)
    ik = np.zeros((4, IK), np.int8)
    groups = [(64, [(0, KV), (1, IK)])]
    with pytest.raises(tierkv.RegisterError, match="unknown page format"):
        tierkv.HostTier([kv, ik], groups, ["kv/fp8"], 1, 4)
    with pytest.raises(tierkv.RegisterError, match="index_k/fp8 is configured but no layer"):
        tierkv.HostTier([kv], [(64, [(0, KV)])], FORMATS, 1, 4)
    ro = kv.copy()
    ro.setflags(write=False)
    with pytest.raises(tierkv.RegisterError, match="read-only"):
        tierkv.HostTier([ro, ik], groups, FORMATS, 1, 4)
    with pytest.raises(tierkv.RegisterError, match="one-byte"):
        tierkv.HostTier([kv.view(np.int16), ik], groups, FORMATS, 1, 4)
    with pytest.raises(tierkv.RegisterError, match="shape"):
        tierkv.HostTier([kv.reshape(-1), ik], groups, FORMATS, 1, 4)

    class OnTheGpu:
        __cuda_array_interface__ = {"data": (0x7F0000000000, False), "shape": (4, KV), "typestr": "|i1", "version": 3}

    # Without the CUDA backend GPU memory is refused as such; with it, anything but a torch
    # tensor is.
    refusal = "not a cache array" if "cuda" in tierkv.BACKENDS else "GPU memory.*no CUDA backend"
    with pytest.raises(tierkv.RegisterError, match=refusal):
        tierkv.HostTier([OnTheGpu(), ik], groups, FORMATS, 1, 4)
    with pytest.raises(tierkv.RegisterError, match="an? object is not a cache array"):
        tierkv.HostTier([object(), ik], groups, FORMATS, 1, 4)

    # An object that names memory it does not hold is refused: only numpy arrays are taken,
    # through numpy's own interface.
    class Liar:
        __array_interface__ = {"data": (0x1000, False), "shape": (4, KV), "typestr": "|i1", "version": 3}

    with pytest.raises(tierkv.RegisterError, match="Liar is not a cache array"):
        tierkv.HostTier([Liar(), ik], groups, FORMATS, 1, 4)

    class Subclass(np.ndarray):
        @property
        def __array_interface__(self):
            return {"data": (0x1000, False), "shape": (4, KV), "typestr": "|i1", "version": 3}

    sub = kv.view(Subclass)
    tier = tierkv.HostTier([sub, ik], groups, FORMATS, 1, 4)  # numpy's own address, not 0x1000
    ptrs = np.array([kv.ctypes.data, ik.ctypes.data], np.uint64).tobytes()
    tier.store(1, ptrs, np.array([KV, IK], np.uint64).tobytes(), [1], [2], [0], np.array([0], np.uint64).tobytes())
    assert tier.get_finished()[0][1] is True
    with pytest.raises(tierkv.RegisterError, match="above the"):
        tierkv.HostTier([kv, ik], groups, FORMATS, 1 << 20, 1 << 30)


def test_jobs_outside_the_registration_are_refused_and_copy_nothing():
    kv, ik = caches(4, 3)
    tier = tierkv.HostTier([kv, ik], [(64, [(0, KV), (1, IK)])], FORMATS, 1, 4)
    chunk = np.array([0], np.uint64).tobytes()
    ptrs, sizes = pointers([kv, ik], [(0, KV), (1, IK)], [1])
    # An address one page past the cache's end.
    bad = np.frombuffer(ptrs, np.uint64).copy()
    bad[0] += 3 * KV
    with pytest.raises(tierkv.PlanError, match="job 5: .*not the start of a page of cache tensor 0"):
        tier.store(5, bad.tobytes(), sizes, [1], [2], [0], chunk)
    with pytest.raises(tierkv.PlanError, match="host chunk 4 is out of range"):
        tier.store(5, ptrs, sizes, [1], [2], [0], np.array([4], np.uint64).tobytes())
    with pytest.raises(tierkv.PlanError, match="not a whole number"):
        tier.store(5, ptrs[:-1], sizes, [1], [2], [0], chunk)
    with pytest.raises(tierkv.PlanError, match="layer references"):
        tier.store(5, ptrs, sizes, [1], [1], [0], chunk)
    assert tier.get_finished() == []
    assert all(b == 0 for b in tier.read_host(0, 0))
    with pytest.raises(tierkv.PlanError, match="does not exist"):
        tier.read_host(2, 0)
