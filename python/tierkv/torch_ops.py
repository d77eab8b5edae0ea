"""``tierkv.ops`` registered as torch custom ops: ``torch.ops.tierkv.*``.

Importing this module (it needs torch) registers four ops with ``torch.library.custom_op``, each
calling the op of the same name in :mod:`tierkv.ops` on the caller's current stream:

- ``torch.ops.tierkv.index_k_store(keys, kv_cache, slot_mapping, gamma, beta, rope, dtype,
  ue8m0)``: writes ``kv_cache`` (declared mutated), returns nothing;
- ``torch.ops.tierkv.paged_mqa_logits(q, kv_cache, weights, context_lens, block_table,
  max_context_len, dtype, kernel)``: a new float32 ``[rows, max_context_len]``;
- ``torch.ops.tierkv.topk(logits, context_lens, k, block_table=None)``: a new int32
  ``[rows, k]``;
- ``torch.ops.tierkv.copy_pages(src, dst, src_pages, dst_pages)``: writes ``dst`` (declared
  mutated), returns nothing.

Each has a fake implementation (output shapes and types only), so ``torch.compile`` traces
through the ops without a graph break, and ``torch.library.opcheck`` holds for them with an fp8
``q`` given as ``torch.uint8`` bytes (``python/tests/test_torch_ops.py``; with a
``torch.float8_e4m3fn`` ``q``, opcheck's schema check fails inside torch's own comparison of
fp8 tensors, while the op itself runs). Arguments, refusals and stream semantics are those of
:mod:`tierkv.ops`; the registered ops take no ``out=`` (a custom op returns fresh tensors). The
dispatcher adds host time to every call, compiled code included (a compiled region still calls
each op's Python implementation): the plain ``tierkv.ops`` functions are cheaper. Only a CUDA
graph's replay runs the ops without host work.

Under ``torch.compile``, ``copy_pages`` with a destination that is also its source reads the
source as it was before the call (functionalisation), where an eager host call copies pairs in
order; on the GPU such pairs have no defined order either way.

Tensors only (no numpy arrays); an fp8 ``q`` may be ``torch.float8_e4m3fn`` or its bytes as
``torch.uint8``.
"""

from typing import Optional

import torch

from . import ops

__all__ = ["copy_pages", "index_k_store", "paged_mqa_logits", "topk"]


@torch.library.custom_op("tierkv::index_k_store", mutates_args=("kv_cache",))
def index_k_store(
    keys: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    rope: torch.Tensor,
    dtype: str = "fp8",
    ue8m0: bool = False,
) -> None:
    ops.index_k_store(keys, kv_cache, slot_mapping, gamma, beta, rope, dtype=dtype, ue8m0=ue8m0)


@index_k_store.register_fake
def _(keys, kv_cache, slot_mapping, gamma, beta, rope, dtype="fp8", ue8m0=False):
    return None


@torch.library.custom_op("tierkv::paged_mqa_logits", mutates_args=())
def paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    dtype: str = "fp8",
    kernel: str = "tensor_core",
) -> torch.Tensor:
    return ops.paged_mqa_logits(
        q, kv_cache, weights, context_lens, block_table, max_context_len, dtype=dtype, kernel=kernel
    )


@paged_mqa_logits.register_fake
def _(q, kv_cache, weights, context_lens, block_table, max_context_len, dtype="fp8", kernel="tensor_core"):
    if max_context_len < 0:
        raise ops.OpError(
            f"tierkv.ops.paged_mqa_logits: `max_context_len` is {max_context_len}, not an integer >= 0"
        )
    return q.new_empty((q.shape[0], max_context_len), dtype=torch.float32)


@torch.library.custom_op("tierkv::topk", mutates_args=())
def topk(
    logits: torch.Tensor,
    context_lens: torch.Tensor,
    k: int,
    block_table: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return ops.topk(logits, context_lens, k, block_table=block_table)


@topk.register_fake
def _(logits, context_lens, k, block_table=None):
    if k < 1:
        raise ops.OpError(f"tierkv.ops.topk: `k` is {k}, not an integer >= 1")
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)


@torch.library.custom_op("tierkv::copy_pages", mutates_args=("dst",))
def copy_pages(
    src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor
) -> None:
    ops.copy_pages(src, dst, src_pages, dst_pages)


@copy_pages.register_fake
def _(src, dst, src_pages, dst_pages):
    return None
