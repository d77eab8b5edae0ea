"""tierkv.ops on CUDA tensors (skipped without a CUDA build of tierkv, torch or a GPU): each op
equal to the same op on host arrays (the CPU references; bit for bit, except the tensor-core
logits, held to 1e-5 of each logit's magnitude), ordered after the caller's stream and before
its next work without synchronising, and index entries refused on the GPU (DeviceIndexError)."""

import numpy as np
import pytest

import tierkv
from tierkv import ops

torch = pytest.importorskip("torch")
if "cuda" not in tierkv.BACKENDS or not torch.cuda.is_available():
    pytest.skip("needs tierkv built with --features cuda, and a GPU", allow_module_level=True)

FP8_PAGE, BF16_PAGE = 64 * 132, 64 * 256


def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def store_inputs(n, seed):
    g = gen(seed)
    keys = (torch.randn(n, 128, device="cuda", generator=g) * 2).bfloat16()
    gamma = torch.rand(128, device="cuda", generator=g) + 0.5
    beta = torch.randn(128, device="cuda", generator=g) * 0.1
    ang = torch.rand(n, 32, device="cuda", generator=g) * 6.28
    rope = torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()
    return keys, gamma, beta, rope


def host(t):
    """A host (numpy) copy; bf16 as its bits."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().copy()


def fp8_codes(shape, g):
    c = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=g)
    c[(c & 0x7F) == 0x7F] = 0
    return c


def fp8_cache(blocks, g):
    cache = torch.empty(blocks, FP8_PAGE, dtype=torch.uint8, device="cuda")
    cache[:, :8192] = fp8_codes((blocks, 8192), g)
    scales = torch.rand(blocks, 64, device="cuda", generator=g) * 0.1 + 0.01
    cache[:, 8192:] = scales.view(torch.uint8).view(blocks, 256)
    return cache


@pytest.mark.parametrize("dtype,ue8m0", [("fp8", False), ("fp8", True), ("bf16", False)])
def test_index_k_store_equals_the_host_op(dtype, ue8m0):
    n, blocks = 5000, 100
    page = FP8_PAGE if dtype == "fp8" else BF16_PAGE
    keys, gamma, beta, rope = store_inputs(n, 1)
    slots = torch.randperm(blocks * 64, device="cuda", generator=gen(2))[:n].int()
    slots[::97] = -1
    cache = torch.zeros(blocks, page, dtype=torch.uint8, device="cuda")
    ops.index_k_store(keys, cache, slots, gamma, beta, rope, dtype=dtype, ue8m0=ue8m0)
    want = np.zeros((blocks, page), dtype=np.uint8)
    ops.index_k_store(host(keys), want, host(slots), host(gamma), host(beta), host(rope),
                      dtype=dtype, ue8m0=ue8m0)
    assert np.array_equal(host(cache), want)


def logits_inputs(rows, heads, ctx, seed):
    g = gen(seed)
    pages = ctx // 64
    cache = fp8_cache(rows * pages, g)
    q = fp8_codes((rows, heads, 128), g)
    w = torch.randn(rows, heads, device="cuda", generator=g)
    table = torch.randperm(rows * pages, device="cuda", generator=g).int().view(rows, pages)
    lens = torch.randint(0, ctx + 1, (rows,), device="cuda", generator=g).int()
    lens[0] = ctx
    return q, cache, w, lens, table


def magnitude(q, cache, w, table):
    """Each logit's magnitude: sum over heads of |w| x ReLU(q . k) x scale, in f64."""
    qf = q.view(torch.float8_e4m3fn).double()
    vals = cache[:, :8192].contiguous().view(torch.float8_e4m3fn).double().view(-1, 64, 128)
    scales = cache[:, 8192:].contiguous().view(torch.float32).double()
    k = vals[table.long()].flatten(1, 2)  # [rows, ctx, 128]
    s = scales[table.long()].flatten(1, 2)
    qk = torch.einsum("rhd,rnd->rhn", qf, k).relu() * s[:, None, :]
    return torch.einsum("rh,rhn->rn", w.double().abs(), qk)


def test_paged_mqa_logits_equals_the_host_op():
    rows, heads, ctx = 8, 64, 4096
    q, cache, w, lens, table = logits_inputs(rows, heads, ctx, 3)
    want = ops.paged_mqa_logits(host(q), host(cache), host(w), host(lens), host(table), ctx)
    exact = ops.paged_mqa_logits(q, cache, w, lens, table, ctx, kernel="exact")
    assert np.array_equal(host(exact), want)
    mag = host(magnitude(q, cache, w, table))
    for kernel in ("tensor_core", "mma"):
        got = host(ops.paged_mqa_logits(q, cache, w, lens, table, ctx, kernel=kernel))
        assert np.array_equal(np.isinf(got), np.isinf(want)), kernel
        fin = np.isfinite(want)
        assert np.all(np.abs(got[fin] - want[fin]) <= 1e-5 * mag[fin] + 1e-30), kernel


def test_topk_equals_the_host_op():
    g = gen(4)
    rows, width = 12, 70_000  # longer than one CTA stages: clusters of CTAs per row
    logits = torch.randint(-50, 50, (rows, width), device="cuda", generator=g).float()
    lens = torch.randint(0, width + 1, (rows,), device="cuda", generator=g).int()
    lens[0], lens[1] = width, 5
    table = torch.randint(0, 1 << 20, (rows, width // 64 + 1), device="cuda", generator=g).int()
    for k in (1, 100, 512, 2048):
        got = ops.topk(logits, lens, k)
        assert np.array_equal(host(got), ops.topk(host(logits), host(lens), k)), k
    got = ops.topk(logits, lens, 512, block_table=table)
    assert np.array_equal(host(got), ops.topk(host(logits), host(lens), 512, block_table=host(table)))


def test_copy_pages_gathers_and_scatters_as_torch_indexing():
    g = gen(5)
    src = torch.randint(-128, 128, (1000, 64, 132), dtype=torch.int8, device="cuda", generator=g)
    dst = torch.zeros(300, 64 * 132, dtype=torch.int8, device="cuda")
    sp = torch.randperm(1000, device="cuda", generator=g)[:300].int()
    dp = torch.randperm(300, device="cuda", generator=g).int()
    ops.copy_pages(src, dst, sp, dp)
    want = torch.zeros_like(dst)
    want[dp.long()] = src.view(1000, -1)[sp.long()]
    assert torch.equal(dst, want)


def test_ops_run_after_the_callers_stream_and_before_its_next_work():
    """200 rounds on a side stream: a torch kernel writes the input after a delay and the op
    reads it at once; the op writes a large output and a torch kernel reads it at once."""
    side = torch.cuda.Stream()
    g = gen(6)
    inputs = [torch.randn(4, 4096, device="cuda", generator=g) for _ in range(8)]
    lens = torch.full((4,), 4096, dtype=torch.int32, device="cuda")
    x = torch.empty(4, 4096, device="cuda")
    big_src = torch.randint(-128, 128, (64, 1 << 20), dtype=torch.int8, device="cuda", generator=g)
    big_dst = torch.zeros_like(big_src)
    ids = torch.arange(64, dtype=torch.int32, device="cuda")
    outs, sums = [], []
    with torch.cuda.stream(side):
        for i in range(200):
            torch.cuda._sleep(20_000)
            x.copy_(inputs[i % 8])
            outs.append(ops.topk(x, lens, 64))
            big_dst.zero_()
            ops.copy_pages(big_src, big_dst, ids, ids)
            sums.append(big_dst.view(torch.uint8).sum(dtype=torch.int64))
    side.synchronize()
    want = [host(ops.topk(inp, lens, 64)) for inp in inputs]
    assert all(np.array_equal(host(o), want[i % 8]) for i, o in enumerate(outs))
    total = big_src.view(torch.uint8).sum(dtype=torch.int64)
    assert all(int(s) == int(total) for s in sums)


def test_ops_do_not_synchronise():
    torch.cuda.synchronize()
    logits = torch.randn(64, 65536, device="cuda")
    lens = torch.full((64,), 65536, dtype=torch.int32, device="cuda")
    ops.topk(logits, lens, 2048)  # the first call loads the kernels
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on the current stream
    out = ops.topk(logits, lens, 2048)
    # Had the call synchronised, the sleep before it would have ended.
    done = torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert not done
    assert np.array_equal(host(out), ops.topk(host(logits), host(lens), 2048))


def test_ops_replay_inside_a_cuda_graph():
    """The four ops captured once in a torch CUDA graph, in a chain (a store into an index-K
    cache, the logits over that cache, their top-k, a gather of the cache's blocks), then
    replayed three times over new keys and queries written in place: every replay equals the
    same ops called eagerly on those inputs. One eager call of each op comes first (it loads the
    kernels and sizes tierkv's scratch: nothing may be allocated inside a capture); a call that
    would grow the scratch inside a capture is refused, and one outside grows it without
    breaking the graph."""
    rows, pages, heads = 4, 16, 64
    blocks, ctx = rows * pages, pages * 64
    g = gen(7)
    keys, gamma, beta, rope = store_inputs(blocks * 64, 8)
    slots = torch.randperm(blocks * 64, device="cuda", generator=g).int()
    table = torch.randperm(blocks, device="cuda", generator=g).int().view(rows, pages)
    lens = torch.tensor([ctx, 700, 64, 1], dtype=torch.int32, device="cuda")
    q = fp8_codes((rows, heads, 128), g)
    w = torch.randn(rows, heads, device="cuda", generator=g)
    src_pages = torch.randperm(blocks, device="cuda", generator=g)[:20].int()
    dst_pages = torch.arange(20, dtype=torch.int32, device="cuda")

    def chain(cache, gathered):
        ops.index_k_store(keys, cache, slots, gamma, beta, rope)
        logits = ops.paged_mqa_logits(q, cache, w, lens, table, ctx, kernel="exact")
        by_slot = ops.topk(logits, lens, 256, block_table=table)
        by_position = ops.topk(logits, lens, 100)
        ops.copy_pages(cache, gathered, src_pages, dst_pages)
        return logits, by_slot, by_position

    cache = torch.zeros(blocks, FP8_PAGE, dtype=torch.uint8, device="cuda")
    gathered = torch.zeros(20, FP8_PAGE, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(cache, gathered)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(cache, gathered)
    # A call that would grow tierkv's guard array inside a capture is refused; outside one it
    # grows it, and the graph captured over the old array still replays right.
    # (A top-k through a block table: one over positions has no guard array, its kernel checks
    # the lengths itself.)
    rows_max = 1 << 20
    many = torch.zeros(rows_max, 8, device="cuda")
    many_lens = torch.full((rows_max,), 8, dtype=torch.int32, device="cuda")
    many_table = torch.zeros(rows_max, 1, dtype=torch.int32, device="cuda")
    refused = torch.cuda.CUDAGraph()
    with pytest.raises(ops.OpError, match="captured into a CUDA graph"):
        with torch.cuda.graph(refused):
            ops.topk(many, many_lens, 4, block_table=many_table)
    del refused
    ops.topk(many, many_lens, 4, block_table=many_table)
    for round in range(3):
        fresh = store_inputs(blocks * 64, 20 + round)[0]
        keys.copy_(fresh)
        q.copy_(fp8_codes((rows, heads, 128), gen(30 + round)))
        graph.replay()
        want_cache = torch.zeros_like(cache)
        want_gathered = torch.zeros_like(gathered)
        want = chain(want_cache, want_gathered)
        torch.cuda.synchronize()
        assert torch.equal(cache, want_cache), round
        assert torch.equal(gathered, want_gathered), round
        for got, expected, what in zip(captured, want, ("logits", "topk by slot", "topk by position")):
            assert torch.equal(got, expected), (round, what)
    ops.check()


def test_bad_index_entries_are_skipped_and_raised_after():
    ops.check()
    keys, gamma, beta, rope = store_inputs(8, 7)
    cache = torch.zeros(1, FP8_PAGE, dtype=torch.uint8, device="cuda")
    slots = torch.tensor([0, 1, 2, 1_000_000, 4, 5, 6, 7], dtype=torch.int32, device="cuda")
    ops.index_k_store(keys, cache, slots, gamma, beta, rope)
    with pytest.raises(ops.DeviceIndexError, match="slot 1000000 of token 3"):
        ops.check()
    good = slots.clone()
    good[3] = -1
    want = np.zeros((1, FP8_PAGE), dtype=np.uint8)
    ops.index_k_store(host(keys), want, host(good), host(gamma), host(beta), host(rope))
    assert np.array_equal(host(cache), want)
    # A refused page of a block table: that row scores nothing; raised by the next op.
    q, kc, w, lens, table = logits_inputs(3, 8, 256, 8)
    table[1, 0] = 5000
    lens[1] = 256
    out = ops.paged_mqa_logits(q, kc, w, lens, table, 256)
    torch.cuda.synchronize()
    assert torch.isinf(out[1]).all() and torch.isfinite(out[0]).all()
    with pytest.raises(ops.DeviceIndexError, match="not run.*row 1 names page 5000"):
        ops.topk(out, lens, 4)
    ops.check()
    # A row length past the logits' row in a top-k over positions: the top-k kernel itself leaves
    # that row empty and reports it; the other rows are selected.
    lens[2] = 257
    sel = ops.topk(out, lens, 4)
    torch.cuda.synchronize()
    assert (host(sel)[2] == -1).all()
    lens[2] = 256
    assert np.array_equal(host(sel)[0], ops.topk(host(out), host(lens), 4)[0])
    with pytest.raises(ops.DeviceIndexError, match="row 2's context length 257 is outside 0..=256"):
        ops.check()
    lens[2] = -1
    sel = ops.topk(out, lens, 4)
    torch.cuda.synchronize()
    assert (host(sel)[2] == -1).all()
    lens[2] = 256
    with pytest.raises(ops.DeviceIndexError, match="row 2's context length -1 is outside 0..=256"):
        ops.check()
    # A refused pair is not copied; the others are.
    src = torch.ones(4, 16, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(4, 16, dtype=torch.uint8, device="cuda")
    ops.copy_pages(src, dst, torch.tensor([0, 9, 2], dtype=torch.int32, device="cuda"),
                   torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda"))
    with pytest.raises(ops.DeviceIndexError, match="source page 9 of pair 1"):
        ops.check()
    assert host(dst)[:, 0].tolist() == [1, 0, 1, 0]


def test_mixed_devices_and_host_copies_are_refused():
    logits = torch.zeros(2, 64, device="cuda")
    with pytest.raises(ops.OpError, match="one device"):
        ops.topk(logits, torch.full((2,), 64, dtype=torch.int32), 4)
    with pytest.raises(ops.OpError, match="16"):
        ops.copy_pages(torch.zeros(4, 8, dtype=torch.uint8, device="cuda"),
                       torch.zeros(4, 8, dtype=torch.uint8, device="cuda"),
                       torch.zeros(1, dtype=torch.int32, device="cuda"),
                       torch.zeros(1, dtype=torch.int32, device="cuda"))
