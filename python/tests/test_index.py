"""tierkv.OffloadIndex from Python: a block's life, eviction, refusals, events."""

import pytest

import tierkv


def key(i: int, group: int = 0) -> bytes:
    # vLLM's OffloadKey: a 32-byte block hash and a 4-byte big-endian group index.
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def stored(ix, *ids):
    keys = [key(i) for i in ids]
    to_store, chunks, evicted = ix.prepare_store(keys)
    ix.complete_store(to_store, True)
    return chunks, evicted


def test_a_block_is_stored_then_loaded():
    ix = tierkv.OffloadIndex(8)
    assert ix.lookup(key(1)) == "miss"
    to_store, chunks, evicted = ix.prepare_store([key(1), key(2)])
    assert to_store == [key(1), key(2)] and len(set(chunks)) == 2 and evicted == []
    assert ix.lookup(key(1)) == "pending"
    ix.complete_store(to_store, True)
    assert ix.lookup(key(1)) == "hit"
    assert ix.prepare_load([key(2), key(1)]) == [chunks[1], chunks[0]]
    assert ix.evictable == 0
    ix.complete_load([key(1), key(2)])
    assert ix.evictable == 2 and len(ix) == 2 and ix.free_chunks == 6
    ix.check_invariants()


def test_the_least_recently_used_block_is_evicted_and_a_pinned_one_is_not():
    ix = tierkv.OffloadIndex(2)
    stored(ix, 1)
    stored(ix, 2)
    ix.prepare_load([key(1)])  # pinned
    to_store, _, evicted = ix.prepare_store([key(3)])
    assert to_store == [key(3)] and evicted == [key(2)]
    assert ix.prepare_store([key(4)]) is None  # 1 pinned, 3 pending
    ix.check_invariants()


def test_misuse_is_refused_with_the_key_named():
    ix = tierkv.OffloadIndex(2)
    with pytest.raises(tierkv.OffloadError, match="not held"):
        ix.prepare_load([key(9)])
    ix.prepare_store([key(1)])
    with pytest.raises(tierkv.OffloadError, match="not ready"):
        ix.prepare_load([key(1)])
    with pytest.raises(tierkv.OffloadError, match="twice"):
        ix.prepare_store([key(5), key(5)])
    with pytest.raises(tierkv.OffloadError, match="longer than"):
        ix.prepare_store([b"x" * (tierkv.KEY_BYTES_MAX + 1)])
    with pytest.raises(tierkv.OffloadError, match="write_back"):
        tierkv.OffloadIndex(4, "write_back")
    with pytest.raises(tierkv.OffloadError, match="unknown write policy"):
        tierkv.OffloadIndex(4, "lru")
    with pytest.raises(TypeError):
        ix.prepare_store(["not bytes"])
    with pytest.raises(OverflowError):
        tierkv.OffloadIndex(-1)
    assert isinstance(tierkv.OffloadError("x"), ValueError)


def test_the_selective_policy_stores_on_the_second_offer():
    ix = tierkv.OffloadIndex(4, "write_through_selective")
    assert ix.write_policy == "write_through_selective"
    assert ix.prepare_store([key(1)])[0] == []
    assert ix.prepare_store([key(1)])[0] == [key(1)]


def test_events_name_what_was_stored_evicted_and_failed():
    ix = tierkv.OffloadIndex(1, events=True)
    stored(ix, 1)
    _, _, evicted = ix.prepare_store([key(2)])
    assert evicted == [key(1)]
    ix.complete_store([key(2)], False)
    events = ix.take_events()
    assert events == [([key(1)], False, False), ([key(1)], True, False), ([key(2)], True, True)]
    assert ix.take_events() == []


def test_reset_forgets_everything():
    ix = tierkv.OffloadIndex(3)
    stored(ix, 1, 2)
    ix.prepare_store([key(3)])
    ix.reset()
    assert len(ix) == 0 and ix.pending == 0 and ix.free_chunks == 3
    assert ix.lookup(key(1)) == "miss"
    ix.check_invariants()
