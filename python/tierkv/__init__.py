"""tierkv: the host tier of tierkv's KV-cache engine, for LLM servers.

- ``OffloadIndex``: the host tier's index of a server's blocks, keyed by the server's block keys
  (least-recently-used eviction in O(log n), write-through or selective write policy).
- ``HostTier``: host chunks for the server's cache arrays, and each transfer job's copies
  between them, every address checked against the registered caches first.
- ``tierkv.ops``: the indexer's kernels (index-K store, paged MQA logits, top-k, page copies)
  as ops on torch tensors or numpy arrays: the CPU references on host arrays, the CUDA kernels
  on CUDA tensors. ``import tierkv.torch_ops`` (needs torch) registers them as
  ``torch.ops.tierkv.*`` for ``torch.compile``.
- ``tierkv.vllm``: vLLM's offloading spec on top of both (import it only where vLLM is
  installed).

Refusals raise ``OffloadError``, ``RegisterError``, ``PlanError`` (all ``ValueError``) or
``HostMemoryError`` (a ``MemoryError``), each naming what was wrong; the ops raise ``OpError``
(a ``ValueError``) and ``DeviceIndexError``.
"""

from ._core import (
    BACKENDS,
    FORMATS,
    HOST_BYTES_MAX,
    KEY_BYTES_MAX,
    HostMemoryError,
    HostTier,
    OffloadError,
    OffloadIndex,
    PlanError,
    RegisterError,
    __version__,
)
from . import ops

__all__ = [
    "BACKENDS",
    "FORMATS",
    "HOST_BYTES_MAX",
    "KEY_BYTES_MAX",
    "HostMemoryError",
    "HostTier",
    "OffloadError",
    "OffloadIndex",
    "PlanError",
    "RegisterError",
    "__version__",
    "ops",
]
