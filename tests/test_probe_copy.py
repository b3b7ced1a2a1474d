"""The copy path's held captures: a decode step's small captures are copied at once and packed at its end.

Real sockets: a Publisher and a Subscriber over loopback TCP, the copy path between them."""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest
import torch

import probe
from probe._bundle import Bundler, GroupError
from probe._copy import CopyPath
from probe._decode import split_bundle
from probe._held import ARENA_START
from probe._identity import IdentityTracker
from probe._publisher import Publisher
from probe._sites import SiteKey
from probe._wire import BUNDLE_MAX


def _key(i: int, name: str = "resid_post") -> SiteKey:
    site = f"layers.{i}.{name}"
    return SiteKey(site, site.encode(), i)


@pytest.fixture
def bus():
    pub = Publisher("tcp://127.0.0.1:*", run="r1", policy="complete", sndhwm=1000, curve_secret_key=None,
                    stall_timeout=30.0)
    sub = probe.Subscriber(pub.endpoint)
    assert pub.wait_until(lambda: len(pub.subscribers) >= 1, 10)
    path = CopyPath(pub, run=b"r1", capacity=8 << 20, cuda_device=None)
    yield pub, path, sub
    sub.close()


def _finish(pub: Publisher, path: CopyPath, sub: probe.Subscriber) -> list:
    path.flush_device(block=True)
    pub.close({"run": "r1"}, 10.0)
    return list(sub)


def _decode_step(tracker: IdentityTracker, batch: int, past: int = 7):
    ids = torch.arange(batch, dtype=torch.long)[:, None] + 100
    ident = tracker.begin(ids, None, past, batch, 1, None, torch.device("cpu"))
    assert ident.valid is None  # every row real: the held path
    return ident


def test_a_held_capture_keeps_the_values_it_had_and_its_place(bus) -> None:
    """vLLM's C kernel updates the residual stream in place after the hook: a held capture must be a copy taken at
    once, not a reference read at the step's end; a capture that takes the general path in between keeps
    its place in the order."""
    pub, path, sub = bus
    ident = _decode_step(IdentityTracker(np.empty(0, dtype=np.int64)), 4)
    t = torch.randn(4, 1, 64)
    first = t.clone()
    path.capture(_key(0), t, ident)
    t.add_(1.0)  # the model overwrites the buffer in place, as vLLM's C kernel's fused add does
    odd = torch.randn(4, 1, 128)[..., ::2]  # not contiguous: the general path
    path.capture(_key(1), odd, ident)
    path.capture(_key(2), t, ident)
    assert path.queued == 3
    got = _finish(pub, path, sub)
    assert [c.site for c in got] == ["layers.0.resid_post", "layers.1.resid_post", "layers.2.resid_post"]
    assert torch.equal(got[0].tensor, first.reshape(4, 64))
    assert torch.equal(got[1].tensor, odd.reshape(4, 64))
    assert torch.equal(got[2].tensor, (first + 1.0).reshape(4, 64))
    assert got[0].token_ids.tolist() == [100, 101, 102, 103] and got[0].positions.tolist() == [7] * 4
    assert path.captured == pub.published == 3 and path.dropped == 0


def test_a_held_capture_that_does_not_fit_its_step_is_dropped_and_counted(bus) -> None:
    """A tensor whose rows do not match the step is found out when packed: dropped, counted and warned
    once, and the step's other captures still go out."""
    pub, path, sub = bus
    ident = _decode_step(IdentityTracker(np.empty(0, dtype=np.int64)), 4)
    good = torch.randn(4, 1, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path.capture(_key(0), good, ident)
        path.capture(_key(1), torch.randn(6, 32), ident)  # 6 rows in a 4-row step
        path.capture(_key(2), good, ident)
        got = _finish(pub, path, sub)
    assert [c.site for c in got] == ["layers.0.resid_post", "layers.2.resid_post"]
    assert all(torch.equal(c.tensor, good.reshape(4, 32)) for c in got)
    assert path.captured == 3 and path.dropped == 1 and pub.published == 2
    assert path.captured == pub.published + path.dropped + pub.dropped
    assert [str(w.message) for w in caught if "layers.1.resid_post" in str(w.message)], caught


def test_held_captures_beyond_the_arena_all_arrive_in_order(bus) -> None:
    """More held bytes than the arena in one step: the rest take the general path, in order, bit-exact,
    and the arena grows so that the next step holds them all."""
    pub, path, sub = bus
    tracker = IdentityTracker(np.empty(0, dtype=np.int64))
    per = (60_000 // 4) // 8  # 8 rows of 1875 fp32: 60,000 bytes, under the 64 KiB of a small capture
    n_sites = 2 * ARENA_START // 60_000 + 1
    sent = []
    for step in range(2):
        ident = _decode_step(tracker, 8, past=7 + step)
        for i in range(n_sites):
            t = torch.randn(8, 1, per)
            sent.append((f"layers.{i}.resid_post", t.reshape(8, per).clone()))
            path.capture(_key(i), t, ident)
        path.flush_device(block=False)
        if step == 0:
            assert path._arena_size > ARENA_START
    got = _finish(pub, path, sub)
    assert [c.site for c in got] == [s for s, _ in sent]
    assert all(torch.equal(c.tensor, t) for c, (_, t) in zip(got, sent, strict=True))
    assert [c.seq for c in got[:n_sites]] == [0] * n_sites and [c.seq for c in got[n_sites:]] == [1] * n_sites
    assert path.captured == pub.published == 2 * n_sites


def test_a_failed_capture_after_held_ones_keeps_the_counts_exact(bus) -> None:
    """A capture that fails on the general path packs the held ones first; it is counted once, dropped,
    and raised, and the held ones before it are still counted and sent."""
    pub, path, sub = bus
    ident = _decode_step(IdentityTracker(np.empty(0, dtype=np.int64)), 2)
    good = torch.randn(2, 1, 16)
    path.capture(_key(0), good, ident)
    path.capture(_key(1), good, ident)
    with pytest.raises(TypeError, match="cannot be published"):
        path.capture(_key(2), torch.zeros(2, 1, 32, dtype=torch.complex64)[..., ::2], ident)
    path.capture(_key(3), good, ident)
    got = _finish(pub, path, sub)
    assert [c.site for c in got] == ["layers.0.resid_post", "layers.1.resid_post", "layers.3.resid_post"]
    assert (path.captured, path.dropped, pub.published) == (4, 1, 3)


def test_a_held_capture_of_a_dtype_the_wire_lacks_is_counted_and_dropped(bus) -> None:
    """A contiguous decode capture is held before its dtype is looked at; the step's end finds the dtype has
    no wire code, and counts it captured once and dropped."""
    pub, path, sub = bus
    ident = _decode_step(IdentityTracker(np.empty(0, dtype=np.int64)), 2)
    good = torch.randn(2, 1, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path.capture(_key(0), torch.zeros(2, 1, 16, dtype=torch.complex64), ident)
        path.capture(_key(1), good, ident)
        got = _finish(pub, path, sub)
    assert [c.site for c in got] == ["layers.1.resid_post"]
    assert (path.captured, path.dropped, pub.published) == (2, 1, 1)
    assert any("cannot be published" in str(w.message) for w in caught), caught


def test_a_deferred_step_goes_out_as_groups_within_the_bundle_limit(bus) -> None:
    """A decode step's captures of one shape share one header and the token ids (a group); a step larger than a
    bundle is split into groups of several bundles, none over the limit, and arrives whole, in order, bit-exact."""
    pub, path, sub = bus
    ident = _decode_step(IdentityTracker(np.empty(0, dtype=np.int64)), 8)
    tensors = [torch.randn(8, 1, 128) for _ in range(40)]  # 4 KiB each: 160 KiB, three bundles
    items = [(_key(i), t, t._version) for i, t in enumerate(tensors)]
    odd = torch.randn(8, 1, 64)  # another shape in the middle: a group of its own
    items.insert(20, (_key(99, "attn_out"), odd, odd._version))
    assert path.capture_deferred(items, ident) == []
    bundler = path._bundler
    bundles = bundler.sealed + [(bundler.buf, bundler.meta)]
    assert len(bundles) == 3 and all(len(buf) <= BUNDLE_MAX for buf, _ in bundles)
    entries = [e for buf, _ in bundles for e in split_bundle(memoryview(buf))]
    # groups only: the first shape's split in two, the odd one, the rest split in two
    assert all(e[0] == 0 for e in entries) and len(entries) == 5
    got = _finish(pub, path, sub)
    want = [(k.name, t) for k, t, _ in items]
    assert [c.site for c in got] == [name for name, _ in want]
    assert all(torch.equal(c.tensor, t.reshape(8, -1)) for c, (_, t) in zip(got, want, strict=True))
    assert all(c.token_ids.tolist() == list(range(100, 108)) and c.positions.tolist() == [7] * 8 for c in got)
    assert path.captured == pub.published == 41 and path.dropped == 0


def test_a_group_member_that_fails_leaves_the_group_whole_and_the_counts_exact(bus) -> None:
    """A member whose bytes cannot be appended (here: not a buffer) ends its group there: the members before it
    are sent, it and the rest are counted dropped, and the bundle stays well-formed."""
    pub, path, sub = bus
    ident = _decode_step(IdentityTracker(np.empty(0, dtype=np.int64)), 2)
    good = torch.randn(2, 1, 16)
    run = [(_key(0), good.numpy().tobytes()), (_key(1), object()), (_key(2), good.numpy().tobytes())]
    failed: list = []
    path._group(ident, (1, 16, 2, ident.rows(1)[1], good.nbytes), run, 0, failed)
    assert [k.name for k, _ in failed] == ["layers.1.resid_post", "layers.2.resid_post"]
    assert isinstance(failed[0][1], TypeError)
    got = _finish(pub, path, sub)
    assert [c.site for c in got] == ["layers.0.resid_post"] and torch.equal(got[0].tensor, good.reshape(2, 16))
    assert (path.captured, path.dropped, pub.published) == (3, 2, 1) and sub.stats.malformed == 0


def test_a_group_whose_header_cannot_be_packed_leaves_nothing_behind() -> None:
    """A group header that does not fit its fields (a width over u32) raises GroupError(0): no byte of it is in the
    bundle and no site's sequence number moved, so the next capture of each site gets the number it would have."""
    ident = _decode_step(IdentityTracker(np.empty(0, dtype=np.int64)), 1)
    bundler = Bundler(b"r1", {})
    members = [(_key(0), b"\0" * 8), (_key(1), b"\0" * 8)]
    with pytest.raises(GroupError) as err:
        bundler.group(ident, 1, 2**32, 1, ident.rows(1)[1], 8, members, 0)
    assert err.value.written == 0 and isinstance(err.value.__cause__, struct.error)
    assert bundler.seqs == {} and bundler.take() == []


def test_a_steps_large_captures_leave_at_its_end_in_order_even_beyond_the_ring() -> None:
    """Large captures are staged in the ring and sent at the step's end in one burst, in capture order with the
    small ones around them; a step whose large captures need more than the ring sends its own staged ones to
    make room, instead of waiting on them (with a short stall limit, that wait would drop captures)."""
    pub = Publisher("tcp://127.0.0.1:*", run="r1", policy="complete", sndhwm=1000, curve_secret_key=None,
                    stall_timeout=2.0)
    sub = probe.Subscriber(pub.endpoint)
    assert pub.wait_until(lambda: len(pub.subscribers) >= 1, 10)
    path = CopyPath(pub, run=b"r1", capacity=256 << 10, cuda_device=None)  # three 96 KiB captures fill it
    tracker = IdentityTracker(np.empty(0, dtype=np.int64))
    ident = tracker.begin(torch.arange(384)[None] % 50 + 3, None, 0, 1, 384, None, torch.device("cpu"))
    big = [torch.randn(1, 384, 64) for _ in range(6)]  # 96 KiB each: the ring path
    small = torch.randn(1, 8, 64)  # 2 KiB, its own step shape: the bundle
    small_ident = tracker.begin(torch.arange(8)[None] + 3, None, 0, 1, 8, None, torch.device("cpu"))
    order = []
    for i, t in enumerate(big):
        path.capture(_key(i), t, ident)
        order.append(f"layers.{i}.resid_post")
        if i == 1:
            assert pub.published == 0 and path.queued == 2  # staged, waiting for the step's end
        if i == 2:
            path.capture(_key(0, "mlp_out"), small, small_ident)
            order.append("layers.0.mlp_out")
    got = _finish(pub, path, sub)
    assert [c.site for c in got] == order
    for c, t in zip([c for c in got if c.site.endswith("resid_post")], big, strict=True):
        assert torch.equal(c.tensor, t[0])
    assert path.captured == pub.published == 7 and path.dropped == 0 and pub.dropped == 0
    sub.close()
