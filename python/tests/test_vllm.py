"""tierkv.vllm against vLLM's own classes (skipped where vLLM is not installed; written against
vLLM 0.34.0): the spec loaded by name as vLLM's factory loads it, the manager beside vLLM's CPU
manager on the same calls, and the worker on device pointers resolved by vLLM's own code."""

import json
import os
import pathlib
import random

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingWorker,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers  # noqa: E402

import tierkv  # noqa: E402
from tierkv.vllm import TierkvOffloadingManager, TierkvOffloadingSpec  # noqa: E402

KV = 64 * 656
IK = 64 * 132


def config(extra, blocks_per_chunk=1, groups=2, events=False):
    return OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(tokens_per_block=64, layer_names=(f"l{g}",), group_id=g) for g in range(groups)),
        worker_kv_bytes_per_block=KV + IK,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id="test",
        model=OffloadingModelConfig(name="deepseek-ai/DeepSeek-V3.2", dtype="fp8_ds_mla"),
        cache=OffloadingCacheConfig(tokens_per_hash=64, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


EXTRA = {
    "spec_name": "TierkvOffloadingSpec",
    "spec_module_path": "tierkv.vllm",
    "cpu_bytes_to_use": 64 * (KV + IK),
    "tierkv_formats": ["kv/fp8_packed", "index_k/fp8"],
}


def test_vllms_factory_loads_the_spec_by_name():
    spec = OffloadingSpecFactory.create_spec(config(EXTRA))
    assert isinstance(spec, TierkvOffloadingSpec)
    assert spec.num_chunks == 64
    assert isinstance(spec.get_manager(), OffloadingManager)
    assert spec.get_manager() is spec.get_manager()


def test_a_spec_without_formats_or_host_bytes_is_refused():
    with pytest.raises(tierkv.RegisterError, match="tierkv_formats"):
        TierkvOffloadingSpec(config({**EXTRA, "tierkv_formats": None}))
    with pytest.raises(tierkv.RegisterError, match="cpu_bytes_to_use"):
        TierkvOffloadingSpec(config({**EXTRA, "cpu_bytes_to_use": 0}))
    with pytest.raises(tierkv.RegisterError, match="holds no chunk"):
        TierkvOffloadingSpec(config({**EXTRA, "cpu_bytes_to_use": 64}))


def key(i, group=0):
    return make_offload_key(i.to_bytes(32, "big"), group)


@pytest.mark.parametrize("seed", range(20))
def test_the_manager_answers_as_vllms_cpu_manager_while_nothing_is_evicted(seed):
    rng = random.Random(seed)
    ours = TierkvOffloadingManager(num_chunks=64)
    theirs = CPUOffloadingManager(num_chunks=64, cache_policy="lru")
    ctx = ReqContext(req_id="r")
    pinned: list = []
    pending: list = []
    for _ in range(200):
        op = rng.choice(["lookup", "store", "store_done", "load", "load_done"])
        if op == "lookup":
            k = key(rng.randrange(40))
            assert ours.lookup(k, ctx) == theirs.lookup(k, ctx)
        elif op == "store":
            keys = [key(i) for i in rng.sample(range(40), rng.randint(1, 4))]
            a, b = ours.prepare_store(keys, ctx), theirs.prepare_store(keys, ctx)
            assert (a is None) == (b is None)
            assert a.keys_to_store == b.keys_to_store and a.evicted_keys == b.evicted_keys == []
            assert isinstance(a.store_spec, CPULoadStoreSpec)
            pending.append(a.keys_to_store)
        elif op == "store_done" and pending:
            keys = pending.pop(rng.randrange(len(pending)))
            ok = rng.random() < 0.8
            ours.complete_store(keys, ctx, ok)
            theirs.complete_store(keys, ctx, ok)
        elif op == "load":
            keys = [k for k in (key(i) for i in range(40)) if theirs.lookup(k, ctx) == LookupResult.HIT]
            if keys:
                keys = rng.sample(keys, min(len(keys), 3))
                spec = ours.prepare_load(keys, ctx)
                theirs.prepare_load(keys, ctx)
                assert isinstance(spec, CPULoadStoreSpec) and len(spec.block_ids) == len(keys)
                pinned.append(keys)
        elif op == "load_done" and pinned:
            keys = pinned.pop(rng.randrange(len(pinned)))
            ours.complete_load(keys, ctx)
            theirs.complete_load(keys, ctx)
    ours.index.check_invariants()


def test_a_full_tier_refuses_a_store_as_vllms_does():
    ctx = ReqContext(req_id="r")
    for manager in (TierkvOffloadingManager(num_chunks=2), CPUOffloadingManager(num_chunks=2)):
        out = manager.prepare_store([key(1), key(2)], ctx)
        assert out is not None
        assert manager.prepare_store([key(3)], ctx) is None  # both pending
        manager.complete_store(out.keys_to_store, ctx)
        evicting = manager.prepare_store([key(3)], ctx)
        assert evicting.keys_to_store == [key(3)] and len(evicting.evicted_keys) == 1


def test_events_follow_vllms_shape():
    ctx = ReqContext(req_id="r")
    ours = TierkvOffloadingManager(num_chunks=1, enable_events=True)
    out = ours.prepare_store([key(1)], ctx)
    ours.complete_store(out.keys_to_store, ctx)
    ours.prepare_store([key(2)], ctx)
    ours.complete_store([key(2)], ctx, success=False)
    events = list(ours.take_events())
    assert [(e.keys, e.removed, e.metadata_only) for e in events] == [
        ([key(1)], False, False),
        ([key(1)], True, False),
        ([key(2)], True, True),
    ]


def canonical(blocks):
    gen = torch.Generator().manual_seed(blocks)
    kv = torch.randint(-128, 128, (blocks, KV), dtype=torch.int8, generator=gen)
    ik = torch.randint(-128, 128, (blocks, IK), dtype=torch.int8, generator=gen)
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=kv, page_size_bytes=KV), CanonicalKVCacheTensor(tensor=ik, page_size_bytes=IK)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=KV)], [CanonicalKVCacheRef(tensor_idx=1, page_size_bytes=IK)]],
    )
    return kv, ik, caches


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_the_worker_moves_blocks_both_ways_on_pointers_vllm_resolved(blocks_per_chunk):
    spec = TierkvOffloadingSpec(config(EXTRA, blocks_per_chunk=blocks_per_chunk))
    kv, ik, caches = canonical(24)
    worker = spec.get_worker(caches)
    assert isinstance(worker, OffloadingWorker)
    rng = np.random.default_rng(blocks_per_chunk)
    originals = (kv.clone(), ik.clone())
    # Store blocks 0..7 of both groups into chunks, wipe the device blocks, load them back.
    # The request's first block is its block 3: with 2 blocks a chunk, it starts in the middle
    # of its first chunk.
    skip = 3 % blocks_per_chunk
    src_blocks = list(rng.choice(24, size=8, replace=False))
    n_chunks = -(-(8 + skip) // blocks_per_chunk)
    chunks = list(rng.choice(spec.num_chunks, size=n_chunks, replace=False))
    gpu = GPULoadStoreSpec(src_blocks * 2, group_sizes=[8, 8], block_indices=[3, 3])
    ptrs = resolve_device_pointers(gpu, caches)
    assert worker.submit_store(1, ptrs, CPULoadStoreSpec(chunks * 2))
    worker.wait({1})
    (done,) = worker.get_finished()
    assert done.job_id == 1 and done.success and done.transfer_size == 8 * (KV + IK)
    assert torch.equal(kv, originals[0]) and torch.equal(ik, originals[1])
    dst_blocks = [b for b in range(24) if b not in src_blocks][:8]
    gpu = GPULoadStoreSpec(dst_blocks * 2, group_sizes=[8, 8], block_indices=[3, 3])
    assert worker.submit_load(2, CPULoadStoreSpec(chunks * 2), resolve_device_pointers(gpu, caches))
    (done,) = worker.get_finished()
    assert done.success
    for s, d in zip(src_blocks, dst_blocks):
        assert torch.equal(kv[d], originals[0][s]) and torch.equal(ik[d], originals[1][s])


def test_a_job_the_tier_refuses_is_reported_failed_so_vllm_recomputes():
    spec = TierkvOffloadingSpec(config(EXTRA))
    kv, ik, caches = canonical(8)
    worker = spec.get_worker(caches)
    gpu = GPULoadStoreSpec([1, 1], group_sizes=[1, 1], block_indices=[0, 0])
    ptrs = resolve_device_pointers(gpu, caches)
    # A host chunk beyond the tier; a negative one; a negative block index.
    assert worker.submit_store(3, ptrs, CPULoadStoreSpec([spec.num_chunks, 0]))
    assert worker.submit_store(4, ptrs, CPULoadStoreSpec([-1, 0]))
    bad = resolve_device_pointers(gpu, caches)
    bad.block_indices = (-1, 0)
    assert worker.submit_load(5, CPULoadStoreSpec([0, 0]), bad)
    done = worker.get_finished()
    assert [(d.job_id, d.success) for d in done] == [(3, False), (4, False), (5, False)]


def test_a_bf16_index_k_cache_behind_fp8_formats_is_refused_at_registration():
    spec = TierkvOffloadingSpec(config(EXTRA))
    kv = torch.zeros((4, KV), dtype=torch.int8)
    ik = torch.zeros((4, 64 * 256), dtype=torch.int8)
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=kv, page_size_bytes=KV), CanonicalKVCacheTensor(tensor=ik, page_size_bytes=64 * 256)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=KV)], [CanonicalKVCacheRef(tensor_idx=1, page_size_bytes=64 * 256)]],
    )
    with pytest.raises(tierkv.RegisterError, match="group 1"):
        spec.get_worker(caches)


FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "sim" / "tests" / "data" / "vllm-0.34-calls.jsonl"


def record_a_server(path, steps=40, blocks=16, seed=7):
    """A small vLLM-like server on vLLM's own classes and tierkv's spec, with ``record_calls``.
    As vLLM 0.34's connector does, a block has one key per KV group (``make_offload_key(hash,
    group)``), each key its own host chunk, and a job moves one request block of the groups
    whose keys were accepted. Each step a request wants 1-3 blocks: those whose keys all hit are
    loaded into blocks it frees, the rest computed and offered for storing; finished jobs are
    completed as the connector does."""
    # As in vLLM, the scheduler's spec and the worker's are two objects (two processes there),
    # each with its own recorder appending to the one file.
    extra = {**EXTRA, "cpu_bytes_to_use": 24 * (KV + IK), "record_calls": str(path)}
    scheduler_spec, worker_spec = TierkvOffloadingSpec(config(extra)), TierkvOffloadingSpec(config(extra))
    kv, ik, caches = canonical(blocks)
    worker, manager = worker_spec.get_worker(caches), scheduler_spec.get_manager()
    ctx, rng = ReqContext(req_id="r"), random.Random(seed)
    free, held, jobs = list(range(blocks)), {}, {}

    def take():
        if free:
            return free.pop()
        busy = {b for (_, _, bl) in jobs.values() for b in bl}
        candidates = sorted(b for b in held if b not in busy)
        if not candidates:
            return None
        b = rng.choice(candidates)
        del held[b]
        return b

    def submit(store, keys, block, groups, host_spec):
        job = submit.next
        submit.next += 1
        gpu = GPULoadStoreSpec([block] * len(groups), group_sizes=[int(g in groups) for g in (0, 1)], block_indices=[0, 0])
        ptrs = resolve_device_pointers(gpu, caches)
        (worker.submit_store(job, ptrs, host_spec) if store else worker.submit_load(job, host_spec, ptrs))
        jobs[job] = (store, list(keys), [block])
    submit.next = 1

    def finish():
        for d in worker.get_finished():
            store, keys, blks = jobs.pop(d.job_id)
            if store:
                manager.complete_store(keys, ctx, d.success)
            else:
                manager.complete_load(keys, ctx)
                held[blks[0]] = keys[0][:32]

    for _ in range(steps):
        for h in dict.fromkeys(rng.randrange(30).to_bytes(32, "big") for _ in range(rng.randint(1, 3))):
            if h in held.values():
                continue
            keys = [make_offload_key(h, g) for g in (0, 1)]
            block = take()
            if block is None:
                break
            if all(manager.lookup(k, ctx) == LookupResult.HIT for k in keys):
                submit(False, keys, block, (0, 1), manager.prepare_load(keys, ctx))
                continue
            held[block] = h  # computed by the request's forward pass
            out = manager.prepare_store(keys, ctx)
            if out is not None and out.keys_to_store:
                groups = tuple(g for g, k in enumerate(keys) if k in out.keys_to_store)
                submit(True, out.keys_to_store, block, groups, out.store_spec)
        if rng.random() < 0.3:
            worker.wait(set(jobs))
        finish()
    worker.wait(set(jobs))
    finish()
    scheduler_spec.recorder.close()
    worker_spec.recorder.close()


def test_the_recorded_call_sequence_is_the_simulators_fixture(tmp_path):
    """sim/tests/data/vllm-0.34-calls.jsonl, which `tierkv sim --profile vllm --calls` replays,
    is what the recorder writes for this server: recorded again here (TIERKV_WRITE_FIXTURE=1
    rewrites it) and compared; every job the tier was given succeeded."""
    path = tmp_path / "calls.jsonl"
    record_a_server(path)
    got = path.read_text()
    if os.environ.get("TIERKV_WRITE_FIXTURE"):
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_text(got)
    assert got == FIXTURE.read_text()
    lines = [json.loads(line) for line in got.splitlines()]
    calls = [c["call"] for c in lines]
    assert calls[0] == "register"
    done = [ok for c in lines if c["call"] == "get_finished" for _, ok in c["done"]]
    assert done and all(done)
    # The worker's recorder never saw the manager's answers: its jobs name chunks, not keys.
    assert all("keys" not in g for c in lines if c["call"].startswith("submit") for g in c["groups"])
    for c in ("lookup", "prepare_store", "submit_store", "prepare_load", "submit_load", "get_finished", "complete_load"):
        assert c in calls, c
