"""tierkv.ops on host arrays (numpy): the CPU references behind the op interface, held to
numpy references written here from the design's definitions (f64 arithmetic, no tierkv code),
and every refusal. The same ops on CUDA tensors are python/tests/test_cuda_ops.py (GPU only)."""

import numpy as np
import pytest

import tierkv
from tierkv import ops

FP8_PAGE = 64 * 128 + 64 * 4  # 64 tokens x 128 fp8 values, then 64 f32 scales
BF16_PAGE = 64 * 128 * 2


def e4m3_table():
    """Every e4m3fn code's value (NaN for 0x7f and 0xff)."""
    out = np.empty(256)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp, man = (b >> 3) & 15, b & 7
        if exp == 15 and man == 7:
            out[b] = np.nan
        elif exp == 0:
            out[b] = sign * man / 8 * 2.0**-6
        else:
            out[b] = sign * (1 + man / 8) * 2.0 ** (exp - 7)
    return out


E4M3 = e4m3_table()


def bf16_to_f64(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def f32_to_bf16_bits(x):
    """Round-to-nearest-even f32 -> bf16 bits (finite inputs)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def hadamard(n):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def pipeline(keys_bits, gamma, beta, rope):
    """LayerNorm -> NeoX RoPE on dims 0..64 -> Hadamard / sqrt(128), in f64."""
    x = bf16_to_f64(keys_bits)
    mean = x.mean(axis=1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=1, keepdims=True)
    x = (x - mean) / np.sqrt(var + 1e-6) * gamma + beta
    cos, sin = rope[:, :32].astype(np.float64), rope[:, 32:].astype(np.float64)
    a, b = x[:, :32].copy(), x[:, 32:64].copy()
    x[:, :32], x[:, 32:64] = a * cos - b * sin, b * cos + a * sin
    return x @ hadamard(128).T / np.sqrt(128.0)


def store_inputs(n, seed=1):
    rng = np.random.default_rng(seed)
    keys = f32_to_bf16_bits(rng.normal(size=(n, 128)).astype(np.float32))
    gamma = rng.uniform(0.5, 1.5, 128).astype(np.float32)
    beta = rng.normal(scale=0.1, size=128).astype(np.float32)
    angle = rng.uniform(0, 6.28, size=(n, 32))
    rope = np.concatenate([np.cos(angle), np.sin(angle)], axis=1).astype(np.float32)
    return keys, gamma, beta, rope


def fp8_rows(cache, slots):
    """Decoded values and scales of fp8 index-K slots: ([n, 128], [n])."""
    pages = cache.reshape(-1, FP8_PAGE)
    vals, scales = [], []
    for s in slots:
        page, t = divmod(int(s), 64)
        vals.append(E4M3[pages[page, t * 128:(t + 1) * 128]])
        scales.append(pages[page, 8192 + 4 * t:8192 + 4 * t + 4].view(np.float32)[0])
    return np.array(vals), np.array(scales, dtype=np.float64)


def test_index_k_store_fp8_matches_the_definition_and_skips_padding():
    n, blocks = 100, 4
    keys, gamma, beta, rope = store_inputs(n)
    rng = np.random.default_rng(2)
    slots = rng.permutation(blocks * 64)[:n].astype(np.int32)
    slots[7] = -1  # a padding token
    cache = np.zeros((blocks, 64, 132), dtype=np.uint8)
    ops.index_k_store(keys, cache, slots, gamma, beta, rope)
    want = pipeline(keys, gamma, beta, rope)
    live = slots != -1
    vals, scales = fp8_rows(cache, slots[live])
    amax = np.abs(want[live]).max(axis=1)
    assert np.allclose(scales, np.maximum(amax, 1e-4) / 448, rtol=1e-5)
    got = vals * scales[:, None]
    # e4m3 keeps 3 mantissa bits: round to nearest is within half a step, 2^-4 of the value,
    # plus the f32 pipeline's error and half the smallest subnormal step.
    tol = 2.0**-4 * np.abs(want[live]) + scales[:, None] * 2.0**-10 + 1e-4
    assert np.all(np.abs(got - want[live]) <= tol)
    # Slots nobody stored stay zero: the padding token wrote nothing.
    written = np.zeros(blocks * 64, dtype=bool)
    written[slots[live]] = True
    untouched = cache.reshape(blocks, FP8_PAGE)[:, :8192].reshape(blocks * 64, 128)[~written]
    assert not untouched.any()


def test_index_k_store_bf16_matches_the_definition():
    n = 64
    keys, gamma, beta, rope = store_inputs(n, seed=3)
    slots = np.arange(n, dtype=np.int32)[::-1].copy()
    cache = np.zeros((1, 64, 128), dtype=np.uint16)
    ops.index_k_store(keys, cache, slots, gamma, beta, rope, dtype="bf16")
    want = pipeline(keys, gamma, beta, rope)
    got = bf16_to_f64(cache.reshape(64, 128)[slots])
    assert np.all(np.abs(got - want) <= 2.0**-8 * np.abs(want) + 1e-5)


def test_a_cache_of_another_layout_is_refused_with_its_sizes():
    keys, gamma, beta, rope = store_inputs(4)
    slots = np.arange(4, dtype=np.int32)
    bf16_cache = np.zeros((2, 64, 128), dtype=np.uint16)  # bf16 index-K behind an fp8 layout
    with pytest.raises(ops.OpError, match=r"16384 bytes.*8448 bytes"):
        ops.index_k_store(keys, bf16_cache, slots, gamma, beta, rope, dtype="fp8")
    with pytest.raises(ops.OpError, match="dtype"):
        ops.index_k_store(keys, bf16_cache, slots, gamma, beta, rope, dtype="fp16")


def test_a_bad_slot_is_refused_before_anything_is_written():
    keys, gamma, beta, rope = store_inputs(3)
    cache = np.zeros((1, FP8_PAGE), dtype=np.uint8)
    for bad in (64, -2):
        slots = np.array([0, bad, 1], dtype=np.int32)
        with pytest.raises(ops.OpError, match=f"slot {bad} of token 1"):
            ops.index_k_store(keys, cache, slots, gamma, beta, rope)
        assert not cache.any()


def make_fp8_cache(blocks, rng):
    """Random finite fp8 codes and positive scales, page by page."""
    cache = np.zeros((blocks, FP8_PAGE), dtype=np.uint8)
    codes = rng.integers(0, 256, size=(blocks, 8192), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    cache[:, :8192] = codes
    scales = rng.uniform(0.01, 0.1, size=(blocks, 64)).astype(np.float32)
    cache[:, 8192:] = scales.view(np.uint8).reshape(blocks, 256)
    return cache


def logits_reference(q, cache, w, lens, table, width):
    out = np.full((len(lens), width), -np.inf)
    pages = cache.reshape(-1, FP8_PAGE)
    for r, n_ctx in enumerate(lens):
        qf = E4M3[q[r]]  # [heads, 128]
        for n in range(n_ctx):
            page, t = table[r, n // 64], n % 64
            key = E4M3[pages[page, t * 128:(t + 1) * 128]]
            scale = pages[page, 8192 + 4 * t:8192 + 4 * t + 4].view(np.float32)[0]
            out[r, n] = (w[r] * np.maximum(qf @ key * scale, 0)).sum()
    return out


def test_paged_mqa_logits_fp8_matches_the_definition():
    rng = np.random.default_rng(4)
    rows, heads, blocks, width = 3, 8, 6, 200
    cache = make_fp8_cache(blocks, rng)
    q = rng.integers(0, 256, size=(rows, heads, 128), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0
    w = rng.normal(size=(rows, heads)).astype(np.float32)
    lens = np.array([200, 65, 0], dtype=np.int32)
    table = rng.integers(0, blocks, size=(rows, 4)).astype(np.int32)
    got = ops.paged_mqa_logits(q, cache, w, lens, table, width)
    want = logits_reference(q, cache, w, lens, table, width)
    assert got.shape == (rows, width) and got.dtype == np.float32
    assert np.array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    mag = np.abs(w)[:, :1].sum() * 1.0 + np.abs(want[fin]).max()
    assert np.all(np.abs(got[fin] - want[fin]) <= 1e-5 * mag)
    # DeepGEMM's [batch, next_n = 1, heads, 128] query shape is the same op.
    again = ops.paged_mqa_logits(q[:, None], cache, w, lens, table, width)
    assert np.array_equal(again, got)


def test_paged_mqa_logits_refusals():
    rng = np.random.default_rng(5)
    cache = make_fp8_cache(2, rng)
    q = np.zeros((2, 4, 128), dtype=np.uint8)
    w = np.ones((2, 4), dtype=np.float32)
    lens = np.array([64, 64], dtype=np.int32)
    table = np.array([[0], [2]], dtype=np.int32)  # page 2 of a 2-page cache
    with pytest.raises(ops.OpError, match="`block_table` row 1 names block 2, outside the cache's 2 blocks"):
        ops.paged_mqa_logits(q, cache, w, lens, table, 64)
    with pytest.raises(ops.OpError, match="next_n"):
        ops.paged_mqa_logits(np.zeros((1, 2, 4, 128), np.uint8), cache, w[:1], lens[:1], table[:1], 64)
    with pytest.raises(ops.OpError, match="`weights` has shape"):
        ops.paged_mqa_logits(q, cache, w[:, :3].copy(), lens, np.zeros((2, 1), np.int32), 64)
    with pytest.raises(ops.OpError, match="float32"):
        ops.paged_mqa_logits(q, cache, w.astype(np.float64), lens, np.zeros((2, 1), np.int32), 64)


def topk_reference(logits, lens, k):
    out = np.full((len(lens), k), -1, dtype=np.int64)
    for r, n in enumerate(lens):
        order = sorted(range(n), key=lambda i: (-logits[r, i], i))[:k]
        out[r, :len(order)] = order
    return out


def test_topk_matches_the_definition_with_ties_padding_and_slots():
    rng = np.random.default_rng(6)
    rows, width = 5, 300
    logits = rng.integers(-20, 20, size=(rows, width)).astype(np.float32)  # many ties
    lens = np.array([300, 10, 0, 129, 2], dtype=np.int32)
    for k in (1, 7, 64, 2048):
        got = ops.topk(logits, lens, k)
        assert np.array_equal(got, topk_reference(logits, lens, k))
    table = rng.integers(0, 1000, size=(rows, 5)).astype(np.int32)
    got = ops.topk(logits, lens, 16, block_table=table)
    pos = topk_reference(logits, lens, 16)
    slots = np.where(pos < 0, -1, table[np.arange(rows)[:, None], pos // 64] * 64 + pos % 64)
    assert np.array_equal(got, slots)


def test_topk_refusals():
    logits = np.zeros((2, 10), dtype=np.float32)
    with pytest.raises(ops.OpError, match="`k`: 2049 is outside 1..=2048"):
        ops.topk(logits, np.array([10, 10], np.int32), 2049)
    with pytest.raises(ops.OpError, match=r"`context_lens` row 1 is 11, outside 0..=10"):
        ops.topk(logits, np.array([10, 11], np.int32), 4)


def test_copy_pages_gathers_scatters_and_refuses_before_copying():
    rng = np.random.default_rng(7)
    src = rng.integers(0, 255, size=(10, 4, 16), dtype=np.uint8)
    dst = np.zeros((6, 64), dtype=np.uint8)
    sp = np.array([9, 0, 3], dtype=np.int32)
    dp = np.array([5, 1, 0], dtype=np.int32)
    ops.copy_pages(src, dst, sp, dp)
    want = np.zeros_like(dst)
    want[dp] = src.reshape(10, 64)[sp]
    assert np.array_equal(dst, want)
    before = dst.copy()
    with pytest.raises(ops.OpError, match="destination page 6 of pair 1"):
        ops.copy_pages(src, dst, np.array([0, 1], np.int32), np.array([0, 6], np.int32))
    assert np.array_equal(dst, before)
    with pytest.raises(ops.OpError, match="equal bytes"):
        ops.copy_pages(src, np.zeros((6, 32), np.uint8), sp, dp)


def test_arrays_are_read_through_dlpack_and_checked():
    logits = np.zeros((4, 10), dtype=np.float32)
    lens = np.full(4, 10, dtype=np.int32)
    with pytest.raises(ops.OpError, match="C-contiguous"):
        ops.topk(np.zeros((10, 4), np.float32).T, lens, 3)
    with pytest.raises(ops.OpError, match="int32"):
        ops.topk(logits, lens.astype(np.int64), 3)
    with pytest.raises(ops.OpError, match="not a DLPack array"):
        ops.topk([[0.0] * 10] * 4, lens, 3)
    with pytest.raises(ops.OpError, match=r"`context_lens` has shape \[3\], expected \[4\]"):
        ops.topk(logits, lens[:3].copy(), 3)


def test_the_error_classes():
    assert issubclass(ops.OpError, ValueError)
    assert issubclass(ops.DeviceIndexError, ops.OpError)
    assert tierkv.ops.OpError is tierkv._core.OpError


def test_torch_cpu_tensors_bf16_and_fp8_dtypes():
    torch = pytest.importorskip("torch")
    n = 70
    keys, gamma, beta, rope = store_inputs(n, seed=8)
    slots = np.arange(n, dtype=np.int32)
    want = np.zeros((2, 64, 132), dtype=np.uint8)
    ops.index_k_store(keys, want, slots, gamma, beta, rope)
    tkeys = torch.from_numpy(keys.view(np.int16)).view(torch.bfloat16)
    cache = torch.zeros((2, 64, 132), dtype=torch.uint8)
    ops.index_k_store(tkeys, cache, torch.from_numpy(slots), torch.from_numpy(gamma),
                      torch.from_numpy(beta), torch.from_numpy(rope))
    assert np.array_equal(cache.numpy(), want)
    # fp8 queries as torch.float8_e4m3fn; the logits come back as a torch tensor.
    rng = np.random.default_rng(9)
    q = rng.integers(0, 256, size=(2, 4, 128), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0
    w = rng.normal(size=(2, 4)).astype(np.float32)
    lens = np.array([70, 3], dtype=np.int32)
    table = np.array([[1, 0], [0, 1]], dtype=np.int32)
    host = ops.paged_mqa_logits(q, want, w, lens, table, 128)
    tq = torch.from_numpy(q).view(torch.float8_e4m3fn)
    got = ops.paged_mqa_logits(tq, cache, torch.from_numpy(w), torch.from_numpy(lens),
                               torch.from_numpy(table), 128)
    assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), host)
    # Another one-byte float type is refused, not read as e4m3.
    with pytest.raises(ops.OpError, match="`q`"):
        ops.paged_mqa_logits(torch.from_numpy(q).view(torch.float8_e5m2), cache, torch.from_numpy(w),
                             torch.from_numpy(lens), torch.from_numpy(table), 128)


def test_empty_arrays_run_and_bad_counts_are_refused():
    keys, gamma, beta, rope = store_inputs(0)
    cache = np.zeros((1, FP8_PAGE), dtype=np.uint8)
    ops.index_k_store(keys, cache, np.zeros(0, np.int32), gamma, beta, rope)
    assert not cache.any()
    ops.copy_pages(cache, cache.copy(), np.zeros(0, np.int32), np.zeros(0, np.int32))
    assert ops.topk(np.zeros((0, 10), np.float32), np.zeros(0, np.int32), 4).shape == (0, 4)
    for k in (0, -1, 2.0, True):
        with pytest.raises(ops.OpError, match="`k` is"):
            ops.topk(np.zeros((1, 10), np.float32), np.full(1, 10, np.int32), k)
    with pytest.raises(ops.OpError, match="`max_context_len` is -1"):
        ops.paged_mqa_logits(np.zeros((1, 4, 128), np.uint8), cache, np.zeros((1, 4), np.float32),
                             np.zeros(1, np.int32), np.zeros((1, 1), np.int32), -1)
    with pytest.raises(ops.OpError, match=r"`q` has shape \[\]"):
        ops.paged_mqa_logits(np.zeros((), np.uint8), cache, np.zeros((1, 4), np.float32),
                             np.zeros(1, np.int32), np.zeros((1, 1), np.int32), 64)


def test_outputs_are_checked_against_the_call():
    logits = np.zeros((2, 10), np.float32)
    lens = np.full(2, 10, np.int32)
    with pytest.raises(ops.OpError, match=r"`out` has shape \[2, 5\], expected \[2, 4\]"):
        ops.topk(logits, lens, 4, out=np.zeros((2, 5), np.int32))
    # An output that shares memory with an input is refused.
    with pytest.raises(ops.OpError, match="`out` shares memory with `logits`"):
        ops.topk(logits, lens, 4, out=_alias(logits))
    cache = np.zeros((1, FP8_PAGE), np.uint8)
    q = np.zeros((1, 4, 128), np.uint8)
    w = np.zeros((1, 4), np.float32)
    with pytest.raises(ops.OpError, match="kernel"):
        ops.paged_mqa_logits(q, cache, w, np.zeros(1, np.int32), np.zeros((1, 1), np.int32), 64,
                             kernel="bogus")
    with pytest.raises(ops.OpError, match="65 heads"):
        ops.paged_mqa_logits(np.zeros((1, 65, 128), np.uint8), cache, np.zeros((1, 65), np.float32),
                             np.zeros(1, np.int32), np.zeros((1, 1), np.int32), 64)


def _alias(logits):
    """An int32 [2, 4] array over the first bytes of ``logits``."""
    return np.frombuffer(logits.data, dtype=np.int32, count=8).reshape(2, 4)


def test_topk_block_table_entries_whose_slots_are_not_int32_are_refused():
    logits = np.zeros((2, 100), np.float32)
    lens = np.array([100, 100], np.int32)
    for bad in (-1, 1 << 30):
        table = np.array([[0, 1], [2, bad]], np.int32)
        with pytest.raises(ops.OpError, match=f"row 1 names page {bad}"):
            ops.topk(logits, lens, 4, block_table=table)
