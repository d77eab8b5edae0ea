"""tierkv's offloading spec for vLLM's native KV offloading (``OffloadingConnector``).

Written and tested against vLLM 0.34.0's ``vllm.v1.kv_offload`` interface (``OffloadingSpec``,
``OffloadingManager``, ``OffloadingWorker``). vLLM loads it by name::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TierkvOffloadingSpec",
        "spec_module_path": "tierkv.vllm", "cpu_bytes_to_use": 68719476736,
        "tierkv_formats": ["kv/fp8_packed", "index_k/fp8"]}}'

``kv_connector_extra_config`` keys read here:

- ``cpu_bytes_to_use`` (required): host bytes for all workers together.
- ``tierkv_formats`` (required): the page formats of the model's layers (``tierkv.FORMATS``).
  Every layer's cache must have the page bytes of one of them at its group's block size, and
  every format must be some layer's; otherwise registration raises ``RegisterError`` naming the
  group and layer (a bf16 index-K cache where fp8 is configured, say).
- ``write_policy``: ``"write_through"`` (default: store every block vLLM offers) or
  ``"write_through_selective"`` (store a block the second time it is offered).
- ``record_calls``: a file to which the calls vLLM makes on the manager and the worker that
  move or place blocks are appended, a JSON line each (keys as hex; the manager's lines with the
  chunks it gave; a job as, per KV group, its device blocks and host chunks).
  ``tierkv sim --profile vllm --calls FILE`` replays it through the host tier under the
  simulator's schedules and driver faults.

The scheduler side (``TierkvOffloadingManager``) keeps ``tierkv.OffloadIndex``; the worker side
(``TierkvOffloadingWorker``) keeps ``tierkv.HostTier``. GPU caches need a wheel built with the
``cuda`` feature (``tierkv.BACKENDS`` lists ``"cuda"``); there each job's copies start after the
work queued so far on PyTorch's current stream.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable

import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    DevicePointers,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from . import HostTier, OffloadIndex, PlanError, RegisterError

logger = logging.getLogger(__name__)

_LOOKUP = {"miss": LookupResult.MISS, "hit": LookupResult.HIT, "pending": LookupResult.HIT_PENDING}


class CallRecorder:
    """Appends vLLM's calls on the manager and the worker to a JSON-lines file (``record_calls``).

    Host chunks link the two sides: the manager's lines carry the chunks its answers gave each
    key, and a job is recorded, per KV group, as its device blocks and host chunks (and the keys
    those hold where this recorder saw the manager's answers: in vLLM the scheduler's and the
    worker's specs are separate objects, in separate processes, each with its own recorder
    appending to the file). Keys are hex; the worker's creation writes the registration. Not
    recorded: ``get_load_source``, ``on_new_request``, ``take_events``, ``reset_cache`` and the
    spec's other hooks, which move no block.
    """

    def __init__(self, path: str):
        # Appended, a whole line per write: two processes (vLLM's scheduler and worker) may share
        # the file.
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed with the spec)
        self._chunk_key: dict[int, str] = {}
        self._bases: list[tuple[int, int]] = []

    def close(self) -> None:
        self._file.close()

    def write(self, **line) -> None:
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()

    def chunks(self, keys, chunks) -> None:
        for k, c in zip(keys, chunks):
            self._chunk_key[int(c)] = bytes(k).hex()

    def register(self, kv_caches, blocks_per_chunk: int, num_chunks: int, formats, policy: str) -> None:
        """Each group's first cache tensor: its address and block stride, to name a job's blocks."""
        self._bases = []
        for refs in kv_caches.group_data_refs:
            t = kv_caches.tensors[refs[0].tensor_idx].tensor if refs else None
            self._bases.append((int(t.data_ptr()), int(t.stride(0)) * t.element_size()) if t is not None else (0, 1))
        self.write(call="register", blocks=int(kv_caches.tensors[0].tensor.shape[0]), chunks=num_chunks,
                   blocks_per_chunk=blocks_per_chunk, formats=list(formats), write_policy=policy)

    def job(self, store: bool, job_id: int, device_ptrs, spec) -> None:
        """A job as, per group, its device blocks, its host chunks and the keys those hold."""
        ptrs, chunks = list(device_ptrs.ptrs), [int(c) for c in spec.block_ids]
        groups, at, chunk_at = [], 0, 0
        for g, (n, refs) in enumerate(zip(device_ptrs.group_block_counts, device_ptrs.group_data_ref_counts)):
            n, refs = int(n), int(refs)
            base, stride = self._bases[g] if g < len(self._bases) else (0, 1)
            blocks = [(int(p) - base) // stride for p in ptrs[at:at + n]]
            used = chunks[chunk_at:chunk_at + n]
            group = {"blocks": blocks, "chunks": used}
            if all(c in self._chunk_key for c in used):
                group["keys"] = [self._chunk_key[c] for c in used]
            groups.append(group)
            at += n * refs
            chunk_at += n
        self.write(call="submit_store" if store else "submit_load", job=job_id, groups=groups)


def _hex(keys):
    return [bytes(k).hex() for k in keys]


class TierkvOffloadingManager(OffloadingManager):
    """The scheduler side: which blocks the host tier holds, in which chunk, and what to evict.

    Single-threaded (the default no-op ``lock``), like vLLM's CPU manager. Misuse by the caller
    (completing a load that was never prepared, loading a block that is not ready) raises
    ``tierkv.OffloadError`` naming the key, where vLLM's CPU manager asserts.
    """

    def __init__(self, num_chunks: int, write_policy: str = "write_through", enable_events: bool = False,
                 recorder: CallRecorder | None = None):
        self._index = OffloadIndex(num_chunks, write_policy, events=enable_events)
        self._rec = recorder

    @property
    def index(self) -> OffloadIndex:
        return self._index

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._index.lookup(key)
        if self._rec:
            self._rec.write(call="lookup", key=bytes(key).hex(), found=found)
        return _LOOKUP[found]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        chunks = self._index.prepare_load(keys)
        if self._rec:
            self._rec.chunks(keys, chunks)
            self._rec.write(call="prepare_load", keys=_hex(keys), chunks=[int(c) for c in chunks])
        return CPULoadStoreSpec(chunks)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if self._rec:
            self._rec.write(call="complete_load", keys=_hex(keys))
        self._index.complete_load(list(keys))

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        out = self._index.prepare_store(keys)
        if self._rec:
            stored, chunks = (None, None) if out is None else (_hex(out[0]), [int(c) for c in out[1]])
            self._rec.write(call="prepare_store", keys=_hex(keys), stored=stored, chunks=chunks)
        if out is None:
            return None
        to_store, chunks, evicted = out
        if self._rec:
            self._rec.chunks(to_store, chunks)
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in to_store],
            store_spec=CPULoadStoreSpec(chunks),
            evicted_keys=[OffloadKey(k) for k in evicted],
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        if self._rec:
            self._rec.write(call="complete_store", keys=_hex(keys), success=bool(success))
        self._index.complete_store(list(keys), success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        self._index.reset()

    def take_events(self) -> Iterable[OffloadingEvent]:
        for keys, removed, store_failed in self._index.take_events():
            if store_failed:
                # A failed store's keys were never announced; a retry may hold them again.
                keys = [k for k in keys if self._index.lookup(k) == "miss"]
                if not keys:
                    continue
            yield OffloadingEvent(
                keys=[OffloadKey(k) for k in keys],
                medium=Medium.CPU,
                removed=removed,
                removal_expected=not removed,
                metadata_only=store_failed,
            )


class TierkvOffloadingWorker(OffloadingWorker):
    """The worker side: the host tier's chunks for this worker's caches, and the copies.

    A job the host tier refuses (an address outside the registered caches, a chunk out of
    range) is reported by ``get_finished`` as failed, so vLLM recomputes those blocks; the
    refusal is logged with what was wrong. ``submit_*`` itself never raises for a job.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, tokens_per_block: Collection[int], formats: list[str], blocks_per_chunk: int, num_chunks: int,
                 recorder: CallRecorder | None = None, write_policy: str = "write_through"):
        tokens_per_block = list(tokens_per_block)
        if len(tokens_per_block) != len(kv_caches.group_data_refs):
            raise RegisterError(
                f"the offloading config has {len(tokens_per_block)} KV groups, the caches "
                f"{len(kv_caches.group_data_refs)}"
            )
        arrays = [_host_array(t.tensor) for t in kv_caches.tensors]
        first = kv_caches.tensors[0].tensor if kv_caches.tensors else None
        self._cuda = getattr(getattr(first, "device", None), "type", None) == "cuda"
        device = (first.device.index or 0) if self._cuda else 0
        groups = [
            (tpb, [(ref.tensor_idx, ref.page_size_bytes) for ref in refs])
            for tpb, refs in zip(tokens_per_block, kv_caches.group_data_refs)
        ]
        self._tier = HostTier(arrays, groups, list(formats), blocks_per_chunk, num_chunks, device=device)
        self._device = device
        self._refused: list[TransferResult] = []
        self._rec = recorder
        if recorder:
            recorder.register(kv_caches, blocks_per_chunk, num_chunks, formats, write_policy)

    @property
    def tier(self) -> HostTier:
        return self._tier

    def _submit(self, store: bool, job_id: int, device_ptrs: DevicePointers, spec: LoadStoreSpec) -> bool:
        what = "store" if store else "load"
        if self._rec:
            self._rec.job(store, job_id, device_ptrs, spec)
        try:
            chunks = np.asarray(spec.block_ids)
            if chunks.size and chunks.min() < 0:
                raise PlanError(f"job {job_id}: a negative host chunk number")
            args = (
                job_id,
                np.ascontiguousarray(device_ptrs.ptrs, dtype=np.uint64).tobytes(),
                np.ascontiguousarray(device_ptrs.sizes, dtype=np.uint64).tobytes(),
                [int(x) for x in device_ptrs.group_block_counts],
                [int(x) for x in device_ptrs.group_data_ref_counts],
                [int(x) for x in device_ptrs.block_indices],
                np.ascontiguousarray(chunks, dtype=np.uint64).tobytes(),
            )
            stream = 0
            if self._cuda:
                import torch

                stream = torch.cuda.current_stream(self._device).cuda_stream
            (self._tier.store if store else self._tier.load)(*args, stream=stream)
        except (PlanError, TypeError, ValueError, OverflowError):
            # A job tierkv cannot take (an address outside the caches, a chunk or block index
            # out of range): nothing was copied; vLLM recomputes its blocks.
            logger.exception("tierkv: %s job %d refused", what, job_id)
            self._refused.append(TransferResult(job_id=job_id, success=False))
        except RuntimeError:
            # The GPU refused a call: get_finished reports the job failed.
            logger.exception("tierkv: %s job %d failed on the GPU", what, job_id)
        return True

    def submit_store(self, job_id: int, device_ptrs: DevicePointers, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(True, job_id, device_ptrs, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, device_ptrs: DevicePointers, expedited: bool = False) -> bool:
        return self._submit(False, job_id, device_ptrs, src_spec)

    def get_finished(self) -> list[TransferResult]:
        done = [
            TransferResult(job_id=j, success=ok, transfer_size=n, transfer_time=s)
            for j, ok, n, s in self._tier.get_finished()
        ]
        done += self._refused
        self._refused = []
        if self._rec:
            self._rec.write(call="get_finished", done=[[d.job_id, bool(d.success)] for d in done])
        return done

    def wait(self, job_ids: set[int]) -> None:
        if self._rec:
            self._rec.write(call="wait", jobs=sorted(int(j) for j in job_ids))
        self._tier.wait(sorted(job_ids))


def _host_array(tensor):
    """A cache tensor as the host tier takes it: CPU tensors as numpy views of their memory;
    anything else as it is (CUDA tensors export ``__cuda_array_interface__``)."""
    device = getattr(tensor, "device", None)
    if getattr(device, "type", None) == "cpu" and hasattr(tensor, "numpy"):
        return tensor.numpy()
    return tensor


class TierkvOffloadingSpec(OffloadingSpec):
    """vLLM's entry point: see the module's docstring for the configuration."""

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        extra = self.extra_config
        cpu_bytes = extra.get("cpu_bytes_to_use")
        if not cpu_bytes or int(cpu_bytes) <= 0:
            raise RegisterError("tierkv: kv_connector_extra_config needs cpu_bytes_to_use (host bytes for all workers)")
        formats = extra.get("tierkv_formats")
        if not formats or isinstance(formats, str):
            raise RegisterError(
                "tierkv: kv_connector_extra_config needs tierkv_formats, the page formats of the "
                "model's layers (a list, e.g. [\"kv/fp8_packed\", \"index_k/fp8\"])"
            )
        self.formats = [str(f) for f in formats]
        self.write_policy = str(extra.get("write_policy", "write_through"))
        per_chunk = config.worker_kv_bytes_per_block * max(config.parallel.world_size, 1) * self.blocks_per_chunk
        self.num_chunks = int(cpu_bytes) // per_chunk if per_chunk > 0 else 0
        if self.num_chunks < 1:
            raise RegisterError(
                f"tierkv: cpu_bytes_to_use ({int(cpu_bytes)}) holds no chunk of {per_chunk} bytes "
                f"({config.worker_kv_bytes_per_block} KV bytes a block, {config.parallel.world_size} "
                f"workers, {self.blocks_per_chunk} blocks a chunk)"
            )
        self._manager: TierkvOffloadingManager | None = None
        self._worker: TierkvOffloadingWorker | None = None
        path = extra.get("record_calls")
        self.recorder = CallRecorder(str(path)) if path else None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = TierkvOffloadingManager(
                self.num_chunks, self.write_policy, self.kv_events_config.enable_kv_cache_events,
                recorder=self.recorder,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = TierkvOffloadingWorker(
                kv_caches, self.tokens_per_block, self.formats, self.blocks_per_chunk, self.num_chunks,
                recorder=self.recorder, write_policy=self.write_policy,
            )
        return self._worker
