"""The CPU reader's output pool: memory is reused only once nothing refers to it (the array, a view,
a buffer), never under a live result; the fallbacks (no reference counts, no mappings, no
MADV_FREE, the setting at 0) give plain NumPy arrays; reads stay exact over reused memory."""

import gc
import mmap

import numpy as np
import pytest
import zarr
from threads import run_switching_often

from napari_tileshard import Dim, Layout, ShardReader, Writer
from napari_tileshard.reader import memory
from napari_tileshard.reader.memory import OutputPool, default_pool_bytes, pool_unsupported_reason

MIB = 1 << 20


def _pool(**kwargs) -> OutputPool:
    if pool_unsupported_reason() is not None:
        pytest.skip(f"the pool is off on this interpreter: {pool_unsupported_reason()}")
    return OutputPool(64 * MIB, min_bytes=MIB, **kwargs)


def test_an_array_from_the_pool_is_an_ordinary_writable_c_array():
    pool = _pool()
    a = pool.empty((512, 1024), np.uint16)
    assert a.shape == (512, 1024) and a.dtype == np.uint16
    assert a.flags.c_contiguous and a.flags.writeable
    a[...] = 7
    assert int(a.sum()) == 7 * a.size
    assert pool.created == 1 and pool.reused == 0


def test_memory_is_reused_only_once_the_array_and_everything_over_it_are_gone():
    pool = _pool()
    a = pool.empty((MIB,), np.uint16)
    address = a.__array_interface__["data"][0]
    view = a[::2].reshape(-1, 8)
    buffer = memoryview(a)
    del a
    b = pool.empty((MIB,), np.uint16)  # the view and the buffer still refer to a's memory
    assert b.__array_interface__["data"][0] != address
    del view
    c = pool.empty((MIB,), np.uint16)  # the buffer still does
    assert c.__array_interface__["data"][0] != address
    del buffer
    d = pool.empty((MIB,), np.uint16)
    assert d.__array_interface__["data"][0] == address
    assert pool.reused == 1 and pool.created == 3
    del b, c, d


def test_a_result_held_is_never_overwritten_by_the_next_one():
    pool = _pool()
    results = []
    for k in range(5):
        out = pool.empty((MIB,), np.uint8)
        out[...] = k
        results.append(out)
    assert [int(r[0]) for r in results] == [0, 1, 2, 3, 4] and all((r == r[0]).all() for r in results)
    assert pool.reused == 0


def test_a_mapping_twice_the_size_is_taken_a_larger_one_is_not():
    pool = _pool()
    big = pool.empty((4 * MIB,), np.uint8)
    del big
    small = pool.empty((MIB,), np.uint8)  # 4x: a new mapping
    assert pool.reused == 0
    del small
    half = pool.empty((2 * MIB,), np.uint8)  # the 4 MiB one is within 2x
    assert pool.reused == 1 and half.nbytes == 2 * MIB


def test_the_pool_forgets_its_oldest_mappings_past_its_cap():
    pool = OutputPool(3 * MIB, min_bytes=MIB) if pool_unsupported_reason() is None else pytest.skip("pool off")
    held = [pool.empty((MIB,), np.uint8) for _ in range(5)]
    assert pool.nbytes <= 3 * MIB
    held[0][...] = 1  # forgotten by the pool, still valid for its holder
    assert int(held[0].sum()) == MIB
    del held
    assert pool.empty((4 * MIB,), np.uint8).nbytes == 4 * MIB  # over the cap: plain NumPy


@pytest.mark.parametrize(
    "implementation, gil_disabled, expected",
    [("cpython", False, None), ("pypy", False, "pypy"), ("cpython", True, "free-threaded")],
)
def test_the_pool_needs_cpythons_reference_counts(implementation, gil_disabled, expected):
    reason = pool_unsupported_reason(implementation, gil_disabled)
    assert reason is None if expected is None else expected in reason


def test_without_the_pool_empty_is_plain_numpy():
    for pool in (OutputPool(64 * MIB, min_bytes=MIB, unsupported="testing"), OutputPool(0)):
        a = pool.empty((MIB,), np.uint16)
        assert a.base is None and a.shape == (MIB,) and pool.created == 0
    small = _pool().empty((100,), np.uint8)  # under min_bytes
    assert small.base is None


def test_when_mappings_fail_the_pool_turns_itself_off(monkeypatch):
    def refused(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refused)
    pool = OutputPool(64 * MIB, min_bytes=MIB)
    assert pool.unsupported is not None
    a = pool.empty((MIB,), np.uint8)
    assert a.base is None and a.nbytes == MIB


def test_without_madvise_free_memory_is_still_reused(monkeypatch):
    monkeypatch.delattr(mmap, "MADV_FREE", raising=False)
    pool = _pool()
    a = pool.empty((MIB,), np.uint8)
    a[...] = 3
    del a
    gc.collect()
    b = pool.empty((MIB,), np.uint8)
    assert pool.reused == 1
    b[...] = 4
    assert int(b.max()) == 4


def test_the_default_cap_follows_the_machine():
    assert default_pool_bytes(8 << 30) == 2 << 30
    assert default_pool_bytes(1 << 30) == 1 << 30
    assert default_pool_bytes(512 << 30) == 16 << 30
    assert default_pool_bytes(0) == 2 << 30  # unknown
    assert 1 << 30 <= default_pool_bytes() <= 16 << 30


def test_the_setting_sets_the_cap_and_zero_turns_the_pool_off(monkeypatch):
    previous = memory.set_output_pool(None)
    try:
        monkeypatch.setenv("TILESHARD_POOL_BYTES", "0")
        assert memory.output_pool().max_bytes == 0
        memory.set_output_pool(None)
        monkeypatch.setenv("TILESHARD_POOL_BYTES", "lots")
        with pytest.raises(ValueError, match="TILESHARD_POOL_BYTES.*'lots'"):
            memory.output_pool()
    finally:
        memory.set_output_pool(previous)


def test_whole_reads_over_reused_memory_equal_zarr_python(tmp_path):
    """Consecutive reads, dropped and kept, land in reused memory and equal zarr-python's."""
    pool = _pool()
    previous = memory.set_output_pool(pool)
    try:
        layout = Layout([Dim("t", 0, 2, 1), Dim("y", 512, 128, 2), Dim("x", 1024, 128, 4)], "uint16")
        rng = np.random.default_rng(1)
        frames = (np.cumsum(rng.integers(0, 3, (9, 512, 1024)), axis=-1) % 900).astype(np.uint16)
        with Writer(tmp_path / "a.zarr", layout, codec="zstd", backend="cpu") as writer:
            for frame in frames:
                writer.append(frame)
        expected = zarr.open_array(tmp_path / "a.zarr", mode="r")[...]
        with ShardReader(tmp_path / "a.zarr", backend="cpu") as reader:
            first = reader.read()
            kept = reader.read()  # while `first` is held: other memory
            assert first.__array_interface__["data"][0] != kept.__array_interface__["data"][0]
            del first
            again = reader.read()  # in first's memory
            assert pool.reused >= 1
            np.testing.assert_array_equal(kept, expected)
            np.testing.assert_array_equal(again, expected)
            plane = reader.read((3,))  # 1 MiB: pooled (min_bytes here)
            np.testing.assert_array_equal(plane, expected[3])
    finally:
        memory.set_output_pool(previous)


def test_cached_units_in_pooled_memory_are_placed_without_a_copy():
    """Rows the chunk cache adopted from a pooled unit (their base a 1-D mapping, not the 2-D
    unit) are handed to the un-tiling as one view of that memory, as rows of a NumPy unit are."""
    from napari_tileshard.format.codecs import REGISTRY
    from napari_tileshard.reader.cpu import BlockSource
    from napari_tileshard.reader.plan import Block

    row_bytes = 1 << 18
    for unit in (_pool().empty((4, row_bytes), np.uint8), np.zeros((4, row_bytes), np.uint8)):
        unit[...] = np.arange(4, dtype=np.uint8)[:, None]
        block = Block("c/0", (0,), (), np.arange(4, dtype=np.int64))
        block.cached = {position: unit[position] for position in range(4)}
        rows = BlockSource(block, [], REGISTRY["zstd"]).cached_rows(0, 4)
        assert rows is not None and rows.shape == (4, row_bytes) and np.shares_memory(rows, unit)
        np.testing.assert_array_equal(rows[:, 0], [0, 1, 2, 3])
        block.cached = {0: unit[0], 1: unit[2], 2: unit[1], 3: unit[3]}  # not back to back
        assert BlockSource(block, [], REGISTRY["zstd"]).cached_rows(0, 4) is None


def test_a_large_mapping_given_back_is_reused_after_madvise_free():
    pool = OutputPool(256 * MIB, min_bytes=MIB) if pool_unsupported_reason() is None else pytest.skip("pool off")
    size = max(memory.FREE_PAGES_MIN_BYTES, MIB)
    a = pool.empty((size,), np.uint8)
    a[...] = 1
    del a  # MADV_FREE where the platform has it
    b = pool.empty((size,), np.uint8)
    assert pool.reused == 1
    b[...] = 2
    assert int(b.min()) == int(b.max()) == 2


def test_chunk_cache_get_many_finds_each_key_and_marks_the_found_ones_used():
    from napari_tileshard.reader.cache import ChunkCache

    cache = ChunkCache(max_bytes=3 * 8)
    cache.adopt_rows([("a", 0), ("a", 1), ("a", 2)], np.arange(24, dtype=np.uint8).reshape(3, 8))
    found = cache.get_many([("a", 0), ("x", 9), ("a", 2)])
    assert found[1] is None and int(found[0][0]) == 0 and int(found[2][0]) == 16
    cache.adopt_rows([("b", 0)], np.zeros((1, 8), dtype=np.uint8))  # ("a", 1) was the least recently used
    assert cache.get(("a", 1)) is None and cache.get(("a", 0)) is not None and cache.get(("a", 2)) is not None


def test_threads_taking_arrays_at_once_never_share_memory():
    """The array over a mapping was made after the pool's lock was released: until it existed the
    mapping looked idle, and another thread took the same memory (3 overlaps in 12,000 takes)."""
    pool = OutputPool(64 << 20, min_bytes=1 << 20)
    overlaps: list = []

    def take(value: int) -> None:
        for _ in range(1500):
            out = pool.empty(1 << 20, np.uint8)
            out[:] = value
            if not (out[::4096] == value).all():
                overlaps.append(value)
            del out

    run_switching_often(take, [(k,) for k in range(1, 5)])
    assert overlaps == [] and pool.reused > 5000


def test_small_mappings_are_kept_up_to_their_own_cap():
    """Mappings too small for MADV_FREE keep their pages resident when idle: reads of many sizes
    would have kept up to the pool's whole cap (a quarter of the RAM) of them."""
    pool = OutputPool(16 << 30, min_bytes=1 << 20)
    sizes = [n << 20 for n in range(20, 64)]  # 20 .. 63 MiB, growing: each takes a new mapping
    for n in sizes:
        pool.empty(n, np.uint8)  # dropped at once: idle (never touched: no memory used)
    assert sum(sizes) > memory.SMALL_MAPPINGS_MAX_BYTES  # 1.8 GiB asked for
    assert pool.created == len(sizes)
    assert memory.SMALL_MAPPINGS_MAX_BYTES - (63 << 20) < pool.nbytes <= memory.SMALL_MAPPINGS_MAX_BYTES


@pytest.mark.parametrize("populate", [True, False], ids=["map-populate", "written-once"])
def test_replenish_makes_ready_the_mappings_reads_had_to_make_afresh(monkeypatch, populate):
    """Each mapping ``empty`` made afresh is made again, idle and faulted in, by ``replenish``;
    the next array of that size takes it, and taking one of those spares asks for another, so
    that as many stay ready while a cache keeps growing.  Without ``MAP_POPULATE`` each page
    is written once instead."""
    if not populate:
        monkeypatch.delattr(mmap, "MAP_POPULATE", raising=False)
    pool = _pool()
    held = [pool.empty((2 * MIB,), np.uint8) for _ in range(2)]
    assert pool.created == 2 and pool.missed == 2
    assert pool.replenish() == 4 * MIB and pool.replenished == 2 and pool.missed == 0
    assert pool.replenish() == 0  # nothing missed since
    more = [pool.empty((2 * MIB,), np.uint8) for _ in range(2)]
    assert pool.created == 2 and pool.reused == 2  # the spares, not new mappings
    assert all(not np.shares_memory(a, b) for a in held for b in more)
    assert pool.missed == 2  # the spares taken: made again next time
    more[0][...] = 5
    assert int(more[0].min()) == 5 and int(held[0].size) == 2 * MIB


def test_replenish_stays_within_its_bound_and_the_pools_cap():
    pool = OutputPool(6 * MIB, min_bytes=MIB) if pool_unsupported_reason() is None else pytest.skip("pool off")
    held = [pool.empty((2 * MIB,), np.uint8) for _ in range(3)]
    assert pool.replenish(max_bytes=3 * MIB) == 2 * MIB  # one of the three fits the bound
    assert pool.missed == 0  # the rest forgotten, not carried over
    held += [pool.empty((2 * MIB,), np.uint8)]
    pool.replenish()
    assert pool.nbytes <= 6 * MIB  # the pool's cap holds for what replenish makes
    del held


def test_a_reader_with_a_cache_replenishes_the_pool_after_a_read_that_needed_fresh_memory(tmp_path):
    """Readers with a chunk cache (napari's) fault in the memory of the next read's new cache
    entries on their background thread; readers without one never do; reads stay exact."""
    pool = _pool()
    previous = memory.set_output_pool(pool)
    try:
        layout = Layout([Dim("t", 0, 2, 1), Dim("y", 512, 128, 2), Dim("x", 1024, 128, 4)], "uint16")
        rng = np.random.default_rng(2)
        frames = rng.integers(0, 4000, (6, 512, 1024)).astype(np.uint16)
        with Writer(tmp_path / "a.zarr", layout, codec="zstd", backend="cpu") as writer:
            for frame in frames:
                writer.append(frame)
        with ShardReader(tmp_path / "a.zarr", backend="cpu", cache_bytes=0) as reader:
            np.testing.assert_array_equal(reader[0], frames[0])
        assert pool.replenished == 0
        with ShardReader(tmp_path / "a.zarr", backend="cpu", cache_bytes=64 * MIB, workers=1) as reader:
            planes = [reader[t] for t in (0, 2, 4)]
        assert pool.replenished >= 1  # close() waits for the background thread
        for t, plane in zip((0, 2, 4), planes):
            np.testing.assert_array_equal(plane, frames[t])
    finally:
        memory.set_output_pool(previous)
