"""tierkv: the host tier of tierkv's KV-cache engine, for LLM servers.

- ``OffloadIndex``: the host tier's index of a server's blocks, keyed by the server's block keys
  (least-recently-used eviction in O(log n), write-through or selective write policy).
- ``HostTier``: host chunks for the server's cache arrays, and each transfer job's copies
  between them, every address checked against the registered caches first.
- ``tierkv.vllm``: vLLM's offloading spec on top of both (import it only where vLLM is
  installed).

Refusals raise ``OffloadError``, ``RegisterError``, ``PlanError`` (all ``ValueError``) or
``HostMemoryError`` (a ``MemoryError``), each naming what was wrong.
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
]
