"""Recycled read buffers (kvforge.store.buffers): memory is reused only once nothing can reach it."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from store_helpers import make_segment

from kvforge.store import DiskStore, buffers
from kvforge.store.codec import segments_equal


@pytest.fixture(autouse=True)
def empty_free_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(buffers, "_free", [])
    monkeypatch.setattr(buffers, "_returned", buffers.collections.deque())


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def test_memory_returns_only_when_every_view_is_gone() -> None:
    a = buffers.take(1 << 16)
    where = _address(a)
    views = [a[10:20].view(np.ndarray), np.asarray(memoryview(a)), torch.frombuffer(a.data, dtype=torch.uint8)[5:]]
    views.append(torch.frombuffer(a[8:].data, dtype=torch.uint8).view(torch.int32)[1:])
    del a
    fresh = []
    for _ in range(len(views)):
        gc.collect()
        fresh.append(buffers.take(1 << 16))  # fresh memory while any view lives (kept: not given back here)
        assert _address(fresh[-1]) != where and buffers.free_bytes() == 0
        views.pop()
    gc.collect()
    assert buffers.free_bytes() == 1 << 16
    assert _address(buffers.take(1 << 16)) == where  # the last view gone: used again


def test_subclass_views_keep_the_memory_too() -> None:
    from kvforge.store.disk import SegmentBytes

    a = buffers.take(4096, SegmentBytes)
    assert isinstance(a, SegmentBytes)
    plain = a[:100].view(np.ndarray)  # numpy collapses this view's base past the subclass
    del a
    gc.collect()
    assert buffers.free_bytes() == 0
    del plain
    gc.collect()
    assert buffers.free_bytes() >= 4096


def test_sizes_and_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    big = buffers.take(10 << 20)
    where = _address(big)
    del big
    assert _address(buffers.take(1 << 20)) != where  # far larger than asked: not used for a small read
    assert _address(buffers.take(9 << 20)) == where  # within the slack
    monkeypatch.setattr(buffers, "MAX_FREE_BYTES", 3 << 20)
    held = [buffers.take(1 << 20) for _ in range(5)]
    del held
    assert buffers.free_bytes() <= 3 << 20


def test_disk_reads_never_hand_out_memory_a_live_segment_uses(tmp_path: Path) -> None:
    first, second = make_segment(seed=1), make_segment(seed=2)  # same shapes, so the same buffer size
    store = DiskStore(tmp_path)
    store.put("a", first)
    store.put("b", second)
    a = store.get("a")
    ptr = a.keys[0].data_ptr()
    b = store.get("b")  # a is alive: fresh memory
    assert b.keys[0].data_ptr() != ptr
    assert segments_equal(a, first) and segments_equal(b, second)
    a.keys[0].add_(1.0)  # writable views: the caller's own copy
    del b
    keys = a.keys  # the segment is gone, its tensors are not
    del a
    gc.collect()
    again = store.get("b")
    assert again.keys[0].data_ptr() != keys[0].data_ptr() and segments_equal(again, second)
    assert torch.equal(keys[0], first.keys[0] + 1.0)
    del keys
    gc.collect()
    assert segments_equal(store.get("a"), first)  # memory reused, bytes all from the new read
