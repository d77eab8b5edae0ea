"""The indexer's kernels as array ops: torch tensors (CPU or CUDA) or numpy arrays, via DLPack.

Host arrays run tierkv's CPU references; CUDA tensors (a build whose ``tierkv.BACKENDS``
contains ``"cuda"``) run its CUDA kernels on tierkv's own stream, ordered after the caller's
current stream by an event and with the caller's stream made to wait for the result: use them
as if they ran on ``torch.cuda.current_stream()``. No call after the first on a device (which
compiles the kernels and allocates pinned memory) synchronises the device.

- ``index_k_store``: raw index keys -> LayerNorm -> RoPE -> Hadamard -> fp8 (+ scale) or bf16
  rows, into the slots of a paged index-K cache (slot -1: skip the token).
- ``paged_mqa_logits``: the indexer's logits over paged keys, DeepGEMM's
  ``fp8_paged_mqa_logits`` signature (differences in docs/TORCH.md).
- ``topk``: each row's k largest logits (any k up to 2048), positions or slots, -1 padded.
- ``copy_pages``: whole blocks between (or within) arrays: gather and scatter.

Arguments are checked before anything runs (shapes, element types, contiguity, alignment, the
cache's page format): ``OpError``. Index entries (slots, block tables, context lengths, page
numbers) are checked on the host for host arrays (``OpError``, nothing written); for CUDA tensors
they stay on the GPU and are checked there: a bad entry is skipped and raised as
``DeviceIndexError`` by the next op on that device or by ``check()``.
"""

from . import _core

OpError = _core.OpError
DeviceIndexError = _core.DeviceIndexError

__all__ = [
    "DeviceIndexError",
    "OpError",
    "check",
    "copy_pages",
    "index_k_store",
    "paged_mqa_logits",
    "topk",
]

_DL_CUDA = 2


def _array(op, name, x):
    """``x`` itself, refused unless it is a DLPack array (the wrapper reads its shape)."""
    if not (hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__")):
        raise OpError(f"tierkv.ops.{op}: `{name}` is not a DLPack array ({type(x).__name__})")
    return x


def _cuda(x):
    """The CUDA ordinal of a DLPack array, or None for host memory."""
    kind, ordinal = x.__dlpack_device__()
    return ordinal if kind == _DL_CUDA else None


def _is_torch(x):
    return type(x).__module__.startswith("torch")


_raw_stream = None


def _stream(x):
    """The caller's current stream handle on ``x``'s device (0 for host arrays)."""
    global _raw_stream
    if _is_torch(x):
        if not x.is_cuda:
            return 0
        if _raw_stream is None:
            import torch

            # torch's own C accessor of the current stream's handle (what torch.compile's
            # generated code calls), where this torch has it: a tenth of current_stream()'s cost.
            _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
                lambda i: torch.cuda.current_stream(i).cuda_stream
            )
        return _raw_stream(x.device.index)
    ordinal = _cuda(x)
    if ordinal is None:
        return 0
    import torch

    return torch.cuda.current_stream(ordinal).cuda_stream


def _bytes_view(x):
    """e4m3 torch tensors as uint8 (DLPack export of float8 types varies across torch versions).
    Other one-byte float types are left alone, so the op refuses them by their type code."""
    if _is_torch(x) and str(x.dtype) == "torch.float8_e4m3fn":
        import torch

        return x.view(torch.uint8)
    return x


def _count(op, name, value, low):
    """A Python integer argument, at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise OpError(f"tierkv.ops.{op}: `{name}` is {value!r}, not an integer >= {low}")
    return value


def _rows(op, name, x, dims):
    """``x``'s first dimension, refused unless ``x`` has ``dims`` or more dimensions."""
    shape = tuple(x.shape)
    if len(shape) < dims:
        raise OpError(f"tierkv.ops.{op}: `{name}` has shape {list(shape)}, expected {dims} or more dimensions")
    return shape[0]


def _out(op, out, shape):
    """An ``out=`` array must have the result's shape."""
    if tuple(out.shape) != tuple(shape):
        raise OpError(f"tierkv.ops.{op}: `out` has shape {list(out.shape)}, expected {list(shape)}")
    return out


def _empty(like, shape, kind):
    """An uninitialised array of ``kind`` ("float32" or "int32") beside ``like``."""
    if _is_torch(like):
        import torch

        return torch.empty(shape, dtype=getattr(torch, kind), device=like.device)
    import numpy

    return numpy.empty(shape, dtype=kind)


def index_k_store(keys, kv_cache, slot_mapping, gamma, beta, rope, *, dtype="fp8", ue8m0=False):
    """Stores ``keys`` (bf16 ``[n, 128]``) into ``kv_cache`` at ``slot_mapping`` (int32 ``[n]``).

    ``gamma``/``beta``: the LayerNorm's f32 ``[128]``; ``rope``: f32 ``[n, 64]`` (each token's 32
    cosines then 32 sines). ``kv_cache``: ``[num_blocks, ...]``, each block one index-K page of
    ``dtype`` ("fp8": 64 x 128 fp8 values then 64 f32 scales, 8448 bytes; "bf16": 64 x 128
    bf16, 16384 bytes); any other block size is refused. ``ue8m0``: fp8 scales rounded up to
    powers of two.
    """
    _core.ops_index_k_store(
        keys, kv_cache, slot_mapping, gamma, beta, rope,
        dtype=dtype, ue8m0=ue8m0, stream=_stream(_array("index_k_store", "keys", keys)),
    )


def paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len,
                     *, dtype="fp8", kernel="tensor_core", out=None):
    """The indexer's logits: ``[rows, max_context_len]`` float32, -inf past each context.

    ``q``: fp8 ``[rows, heads, 128]`` or ``[batch, 1, heads, 128]``; ``weights``: f32
    ``[rows, heads]``; ``context_lens``: int32 ``[rows]``; ``block_table``: int32
    ``[rows, max_blocks]`` (64 tokens a block). ``kernel``: "tensor_core" (default), "mma" or
    "exact" (bit-exact with the CPU reference). ``out``: an output array to fill instead.
    """
    op = "paged_mqa_logits"
    q = _bytes_view(_array(op, "q", q))
    rows = _rows(op, "q", q, 3)
    width = _count(op, "max_context_len", max_context_len, 0)
    if out is None:
        out = _empty(q, (rows, width), "float32")
    else:
        _out(op, _array(op, "out", out), (rows, width))
    _core.ops_paged_mqa_logits(
        q, kv_cache, weights, context_lens, block_table, out,
        dtype=dtype, kernel=kernel, stream=_stream(q),
    )
    return out


def topk(logits, context_lens, k, *, block_table=None, out=None):
    """Each row's ``k`` largest logits among its first ``context_lens[r]``: int32 ``[rows, k]``.

    Best first (a larger logit first, equal logits by lower position), as positions or as slots
    through ``block_table`` (``block_table[r][n // 64] * 64 + n % 64``); -1 past the selection
    (a row shorter than ``k`` selects all of it).
    """
    rows = _rows("topk", "logits", _array("topk", "logits", logits), 2)
    k = _count("topk", "k", k, 1)
    if out is None:
        out = _empty(logits, (rows, k), "int32")
    else:
        _out("topk", _array("topk", "out", out), (rows, k))
    _core.ops_topk(logits, context_lens, out, block_table=block_table, stream=_stream(logits))
    return out


def copy_pages(src, dst, src_pages, dst_pages):
    """Copies block ``src_pages[i]`` of ``src`` to block ``dst_pages[i]`` of ``dst`` (int32)."""
    _core.ops_copy_pages(
        _bytes_view(_array("copy_pages", "src", src)), _bytes_view(dst), src_pages, dst_pages,
        stream=_stream(src),
    )


def check(device=0, *, synchronize=True):
    """Raises ``DeviceIndexError`` for an index entry refused on CUDA ``device``.

    With ``synchronize`` (the default) the caller's current stream is synchronised first, so
    every op queued before this call has been checked; without it, only refusals already
    visible are raised.
    """
    if "cuda" not in _core.BACKENDS:
        raise OpError("tierkv.ops.check: this build of tierkv has no CUDA backend (tierkv.BACKENDS)")
    if synchronize:
        try:
            import torch
        except ImportError as e:
            raise OpError(f"tierkv.ops.check: synchronize=True needs torch ({e})") from e
        torch.cuda.current_stream(device).synchronize()
    found = _core.ops_take_refusal(device)
    if found is not None:
        raise DeviceIndexError(f"tierkv.ops: {found}")
