"""tierkv.torch_ops: the ops registered with torch.library (skipped without torch). On CPU
tensors everywhere, and on CUDA tensors where the build and a GPU allow: each registered op
equals the plain tierkv.ops call, torch.library.opcheck holds for each (schema, declared
mutations, fake implementation, AOT dispatch), and a chain of them compiles with
fullgraph=True (no graph break) to the same results."""

import numpy as np
import pytest

import tierkv
from tierkv import ops

torch = pytest.importorskip("torch")
from tierkv import torch_ops  # noqa: E402  (needs torch)

FP8_PAGE = 64 * 132

DEVICES = ["cpu"]
if "cuda" in tierkv.BACKENDS and torch.cuda.is_available():
    DEVICES.append("cuda")


def inputs(device, seed=1):
    """A small chain's inputs: 128 keys for 2 fp8 index-K blocks, 2 query rows of 4 heads."""
    g = torch.Generator().manual_seed(seed)
    n = 128
    keys = (torch.randn(n, 128, generator=g) * 2).bfloat16()
    gamma = torch.rand(128, generator=g) + 0.5
    beta = torch.randn(128, generator=g) * 0.1
    ang = torch.rand(n, 32, generator=g) * 6.28
    rope = torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()
    slots = torch.randperm(n, generator=g).int()
    q = torch.randint(0, 256, (2, 4, 128), dtype=torch.uint8, generator=g)
    q[(q & 0x7F) == 0x7F] = 0
    w = torch.randn(2, 4, generator=g)
    lens = torch.tensor([128, 70], dtype=torch.int32)
    table = torch.tensor([[1, 0], [0, 1]], dtype=torch.int32)
    pages = (torch.tensor([1, 0], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    out = dict(keys=keys, gamma=gamma, beta=beta, rope=rope, slots=slots, q=q, w=w, lens=lens,
               table=table, src_pages=pages[0], dst_pages=pages[1])
    return {k: v.to(device) for k, v in out.items()}


def chain(op, x, cache, gathered):
    """Store, logits over the stored cache, top-k by slot and by position, a gather: with
    `op` either tierkv.ops or torch.ops.tierkv."""
    op.index_k_store(x["keys"], cache, x["slots"], x["gamma"], x["beta"], x["rope"])
    logits = op.paged_mqa_logits(x["q"], cache, x["w"], x["lens"], x["table"], 128, kernel="exact")
    by_slot = op.topk(logits, x["lens"], 16, block_table=x["table"])
    by_position = op.topk(logits, x["lens"], 16)
    op.copy_pages(cache, gathered, x["src_pages"], x["dst_pages"])
    return logits, by_slot, by_position


def fresh(device):
    cache = torch.zeros(2, FP8_PAGE, dtype=torch.uint8, device=device)
    return cache, torch.zeros_like(cache)


def check_equal(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_registered_ops_equal_the_plain_ops(device):
    x = inputs(device)
    cache, gathered = fresh(device)
    want = chain(ops, x, cache, gathered)
    cache2, gathered2 = fresh(device)
    got = chain(torch.ops.tierkv, x, cache2, gathered2)
    check_equal(got, want)
    assert torch.equal(cache2, cache) and torch.equal(gathered2, gathered)
    assert cache.any() and gathered.any()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_holds_for_each_op(device):
    x = inputs(device)
    cache, gathered = fresh(device)
    chain(ops, x, cache, gathered)  # a stored cache for the readers
    logits = ops.paged_mqa_logits(x["q"], cache, x["w"], x["lens"], x["table"], 128, kernel="exact")
    cases = [
        (torch_ops.index_k_store,
         (x["keys"], torch.zeros_like(cache), x["slots"], x["gamma"], x["beta"], x["rope"])),
        (torch_ops.paged_mqa_logits,
         (x["q"], cache, x["w"], x["lens"], x["table"], 128, "fp8", "exact")),
        (torch_ops.topk, (logits, x["lens"], 16, x["table"])),
        (torch_ops.topk, (logits, x["lens"], 16)),
        (torch_ops.copy_pages, (cache, torch.zeros_like(cache), x["src_pages"], x["dst_pages"])),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_chain_has_no_graph_break(device):
    x = inputs(device, seed=2)
    cache, gathered = fresh(device)
    want = chain(ops, x, cache, gathered)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def compiled(x, cache, gathered):
        return chain(torch.ops.tierkv, x, cache, gathered)

    cache2, gathered2 = fresh(device)
    check_equal(compiled(x, cache2, gathered2), want)
    assert torch.equal(cache2, cache) and torch.equal(gathered2, gathered)


def test_a_refusal_comes_through_the_dispatcher():
    x = inputs("cpu")
    cache, _ = fresh("cpu")
    bad = x["slots"].clone()
    bad[3] = 10_000
    with pytest.raises(ops.OpError, match="slot"):
        torch.ops.tierkv.index_k_store(x["keys"], cache, bad, x["gamma"], x["beta"], x["rope"])
    assert not cache.any()
    # The plain ops' numpy path is not taken: the registered ops take tensors only.
    with pytest.raises(RuntimeError, match="Expected a value of type 'Tensor'"):
        torch.ops.tierkv.topk(np.zeros((1, 4), dtype=np.float32), x["lens"][:1], 2)


def test_a_bad_count_is_refused_when_compiling_too():
    x = inputs("cpu")
    logits = torch.zeros(2, 8)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def compiled(logits, lens, k):
        return torch.ops.tierkv.topk(logits, lens, k)

    with pytest.raises(Exception, match="`k` is 0, not an integer >= 1"):
        compiled(logits, x["lens"], 0)
