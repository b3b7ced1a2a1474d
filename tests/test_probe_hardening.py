"""Nothing hangs, nothing grows without bound: stalled and hostile peers, real processes and sockets."""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from models import build

import probe
from probe._decode import decode_group
from probe._wire import (
    BUNDLE_TOPIC,
    ERROR_KINDS,
    GROUP,
    HEADER,
    MAGIC,
    VERSION,
    encode_bundle,
    encode_envelope,
    encode_group,
)

READER = textwrap.dedent("""
    import json, sys, time, probe
    endpoint, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    sub = probe.Subscriber(endpoint, rcvhwm=int(sys.argv[4]) if len(sys.argv) > 4 else 1000)
    print("ready", flush=True)
    if mode == "stall":                   # connected, never reads
        time.sleep(600)
    if mode == "late":                    # connected, reads only once told to (after the session closed)
        sys.stdin.readline()
    n = 0
    t0 = time.monotonic()
    for cap in sub.iter(idle_timeout=60):
        n += 1
    json.dump({"n": n, "missed": sub.stats.missed, "malformed": sub.stats.malformed, "ended": sub.ended,
               "counts": sub.end_counts, "info": sub.info and sub.info.to_dict()}, open(out, "w"))
""")


def _reader(endpoint: str, out: Path, mode: str, rcvhwm: int = 1000) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", READER, endpoint, str(out), mode, str(rcvhwm)],
                         stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _forward(model: torch.nn.Module, n: int, seq: int = 8) -> None:
    with torch.no_grad():
        for _ in range(n):
            model((torch.arange(seq) % 100 + 3).unsqueeze(0))


def test_best_effort_stalled_subscriber_does_not_starve_a_healthy_one(tmp_path: Path) -> None:
    model = build("llama")
    n_layers = model.config.num_hidden_layers
    # max_delay=0: a message per step, so that the stalled pipe fills (held steps would go 64 KiB at a time)
    with probe.attach(model, "layers.*.resid_post", policy="best_effort", sndhwm=64, max_delay=0) as session:
        stalled = _reader(session.endpoint, tmp_path / "stalled.json", "late", rcvhwm=4)
        healthy = _reader(session.endpoint, tmp_path / "healthy.json", "read")
        session.wait_for_subscribers(2, timeout=30)
        for _ in range(400):  # ~1 MB, far more than the stalled pipe holds
            _forward(model, 1)
            time.sleep(0.001)
    stats = session.stats
    t0 = time.monotonic()
    healthy.wait(timeout=60)
    took = time.monotonic() - t0
    assert stalled.stdin is not None
    stalled.stdin.write("go\n")
    stalled.stdin.flush()
    stalled.wait(timeout=60)
    got = json.loads((tmp_path / "healthy.json").read_text())
    late = json.loads((tmp_path / "stalled.json").read_text())
    assert stats.captured == stats.published + stats.dropped and stats.stall_seconds == 0.0
    assert got["ended"] and got["n"] == stats.published == 400 * n_layers and got["missed"] == 0, got
    assert got["malformed"] == late["malformed"] == 0, "another subscriber's control traffic is not malformed"
    assert took < 10, f"the healthy subscriber got its end of stream {took:.1f}s after close"
    assert got["counts"] == {f"layers.{i}.resid_post": 400 for i in range(n_layers)}
    # the stalled one lost messages at its own full pipe, and knows exactly how many
    assert late["ended"] and late["missed"] > 0 and late["n"] + late["missed"] == stats.published, late


def test_complete_stall_timeout_degrades_and_counters_hold(tmp_path: Path) -> None:
    model = build("llama")
    seen: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.attach(model, "layers.*.resid_post", policy="complete", sndhwm=64, stall_timeout=1.0,
                          max_delay=0) as session:  # a message per step, so that the stalled pipe fills
            stalled = _reader(session.endpoint, tmp_path / "stalled.json", "stall", rcvhwm=2)
            healthy = _reader(session.endpoint, tmp_path / "healthy.json", "read")
            session.wait_for_subscribers(2, timeout=30)
            done = threading.Event()

            def watch() -> None:  # stall_seconds must count a wait while it is still going on
                while not done.is_set():
                    seen.append(session.stats.stall_seconds)
                    time.sleep(0.1)

            w = threading.Thread(target=watch)
            w.start()
            t0 = time.monotonic()
            for _ in range(200):  # ~450 KB, more than the stalled pipe holds; slow enough for the healthy one
                _forward(model, 1)
                time.sleep(0.001)
            took = time.monotonic() - t0
            done.set()
            w.join()
        stats = session.stats
        healthy.wait(timeout=60)
        stalled.kill()
    got = json.loads((tmp_path / "healthy.json").read_text())
    assert stats.degraded and 1.0 <= took < 30
    assert stats.captured == stats.published + stats.dropped == 200 * model.config.num_hidden_layers
    assert any(0.3 < s < 1.2 for s in seen), f"stall_seconds did not grow during the wait: {seen[:20]}"
    assert got["ended"] and got["n"] + got["missed"] == stats.published and got["missed"] == 0
    assert sum("degraded" in str(w.message) for w in caught) == 1


def test_complete_forced_close_keeps_the_identity() -> None:
    model = build("llama")
    session = probe.attach(model, "layers.*.resid_post", policy="complete", sndhwm=2, stall_timeout=None)
    ctx = zmq.Context()
    lazy = ctx.socket(zmq.SUB)  # connects, subscribes, never reads
    lazy.setsockopt(zmq.RCVHWM, 1)
    lazy.setsockopt(zmq.SUBSCRIBE, b"")
    lazy.setsockopt(zmq.SUBSCRIBE, probe._wire.PRESENCE + b"lazy")
    lazy.connect(session.endpoint)
    session.wait_for_subscribers(1, timeout=30)
    t = threading.Thread(target=_forward, args=(model, 100))
    t.start()
    time.sleep(1.0)  # the model thread is now blocked on the full pipe
    stats = session.close(timeout=0.5)  # from another thread: gives up, drops, never hangs
    t.join(timeout=30)
    assert not t.is_alive(), "the model thread stayed blocked after close"
    stats = session.stats
    assert stats.captured == stats.published + stats.dropped and stats.dropped > 0
    assert session.join(timeout=10)
    lazy.close(0)
    ctx.term()


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc for RSS")
def test_captures_larger_than_the_ring_stay_bounded(tmp_path: Path) -> None:
    model = build("llama")  # prefill of 1500 tokens x 64 hidden x 4 B = 384 KiB per capture, ring 64 KiB
    with probe.attach(model, "layers.0.resid_post", policy="best_effort", capacity_bytes=64 << 10) as session:
        slow = _reader(session.endpoint, tmp_path / "slow.json", "read")
        session.wait_for_subscribers(1, timeout=30)
        with pytest.warns(UserWarning, match="exceeds capacity_bytes"):
            _forward(model, 2, seq=1500)
        before = _rss_mb()
        _forward(model, 60, seq=1500)
        grew = _rss_mb() - before
    stats = session.stats
    slow.wait(timeout=60)
    assert stats.dropped == stats.captured == 62 and grew < 40, (stats, grew)
    with probe.attach(model, "layers.0.resid_post", policy="complete", capacity_bytes=64 << 10) as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1, timeout=30)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            before = _rss_mb()
            _forward(model, 20, seq=1500)
            grew = _rss_mb() - before
    caps = list(sub.iter(idle_timeout=5))
    assert len(caps) == 20 and all(c.n_tokens == 1500 for c in caps) and grew < 40, grew


def fail_first_copy(monkeypatch, owner: object, name: str) -> None:
    """Make the copy helper `owner.<name>` (a static method of a class, or a module's function) raise on its first
    call only: a copy that fails is a fault we cannot cause for real."""
    real, calls = getattr(owner, name), []

    def fail_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected copy failure")
        real(*args)

    monkeypatch.setattr(owner, name, staticmethod(fail_once) if isinstance(owner, type) else fail_once)


def check_ring_survives_a_failed_capture(model: torch.nn.Module, forward) -> None:
    """13 forwards of 128 KiB captures into a ring that holds two, the first failing: the other 12 arrive.
    The ring frees its slots in order, so a slot the failed capture left staged would drop all but about one."""
    with probe.attach(model, "layers.0.resid_post", policy="best_effort", capacity_bytes=300 << 10) as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)
        with pytest.warns(UserWarning, match="injected copy failure"):
            forward()
        for _ in range(12):
            forward()
            time.sleep(0.05)  # best_effort: leave ZeroMQ time to free the previous slots
    caps = list(sub.iter(idle_timeout=5))
    stats = session.stats
    assert stats.captured == 13 and stats.dropped == 1 and len(caps) == 12, (stats, len(caps))


@pytest.mark.parametrize("rows", ["all", "some"])
def test_a_failed_large_capture_frees_its_ring_slot(monkeypatch, rows: str) -> None:
    """Every row of a contiguous activation is one memmove into the ring; rows picked out of padding go through
    numpy (`_copy_rows`). A failure in either must free the slot."""
    import probe._copy as copy_path

    model = build("llama")
    if rows == "all":
        fail_first_copy(monkeypatch, copy_path, "_memmove")
        check_ring_survives_a_failed_capture(model, lambda: _forward(model, 1, seq=512))  # 512 x 64 x 4 B = 128 KiB
        return
    ids = (torch.arange(512) % 100 + 3).reshape(2, 256)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: 510 rows of 64 x 4 B, picked out by index

    def forward() -> None:
        with torch.no_grad():
            model(ids, attention_mask=mask)

    fail_first_copy(monkeypatch, copy_path.CopyPath, "_copy_rows")
    check_ring_survives_a_failed_capture(model, forward)


def test_big_payloads_are_zero_copy_views_of_the_frame() -> None:
    model = build("llama")
    with probe.attach(model, "layers.0.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)
        _forward(model, 1, seq=512)  # 512 x 64 x 4 B = 128 KiB: staged whole, sent as one zero-copy frame
    (cap,) = list(sub.iter(idle_timeout=5))
    assert cap.tensor.data_ptr() == np.frombuffer(cap.payload, dtype=np.uint8).ctypes.data
    assert not isinstance(cap.payload.obj, bytes), "the payload must be the frame's own memory"


def test_recv_timeout_is_a_deadline() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = probe.Subscriber(f"tcp://127.0.0.1:{port}", sites="logits")
    pub.recv()
    stop = threading.Event()

    def noise() -> None:  # a message every 20 ms that this subscriber does not want or cannot parse
        while not stop.is_set():
            pub.send(b"logitsX garbage")
            pub.send(b"\x00probebus/info {}")
            time.sleep(0.02)

    t = threading.Thread(target=noise)
    t.start()
    t0 = time.monotonic()
    assert sub.recv(timeout=0.5) is None
    took = time.monotonic() - t0
    stop.set()
    t.join()
    assert 0.45 < took < 1.5, took
    sub.close()
    pub.close(0)


def test_session_info_reaches_late_joiners_and_live_sessions_lists_it(tmp_path: Path) -> None:
    model = build("qwen2")
    # max_delay=0: the three steps before the late joiner are published before it joins, not held for later
    with probe.attach(model, "layers.0.resid_post", max_delay=0) as session:
        listed = {s.run: s for s in probe.live_sessions()}
        assert session.run in listed and listed[session.run].endpoint == session.endpoint
        _forward(model, 3)
        late = probe.Subscriber(session.endpoint)  # joins after three steps went out
        info = late.wait_info(timeout=10)
        assert info is not None and info.run == session.run and info.sites == ["layers.0.resid_post"]
        assert info.dtype == "float32" and info.pid == os.getpid() and info.wire_version == probe.VERSION
        assert info.config_hash and info.probebus_version == probe.__version__
        session.add("layers.1.mlp_out")
        _forward(model, 1)
    caps = list(late.iter(idle_timeout=5))
    assert late.info.sites == ["layers.0.resid_post", "layers.1.mlp_out"]
    assert [c.site for c in caps] == ["layers.0.resid_post", "layers.1.mlp_out"]
    assert late.ended and late.stats.missed == 0  # it joined late: the earlier captures are not "missed"
    assert session.run not in {s.run for s in probe.live_sessions()}
    nobody = probe.Subscriber(f"ipc://{tmp_path}/nobody")
    assert nobody.wait_info(timeout=0.3) is None
    nobody.close()


def test_wire_version_mismatch_warns_once_and_counts() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = probe.Subscriber(f"tcp://127.0.0.1:{port}")
    pub.recv()
    good = encode_envelope(b"r", b"embed", 0, 1, 1, -1, 2, np.zeros((3, 1), np.int64).tobytes(), b"\0" * 8)
    at = len(b"embed") + 1
    old = good[: at + 4] + (VERSION - 1).to_bytes(2, "little") + good[at + 6 :]
    for _ in range(3):
        pub.send(old)
    with pytest.warns(UserWarning, match="wire version") as record:
        assert sub.recv(timeout=1.0) is None
    assert len(record) == 1 and sub.stats.errors == {"version": 3}
    sub.close()
    pub.close(0)


@pytest.mark.filterwarnings("ignore:probebus. the publisher speaks")
def test_a_hundred_thousand_hostile_frames() -> None:
    """Random, truncated, wrong-version and absurd-length frames: no crash, bounded memory, all counted."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.XPUB_NODROP, 1)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = probe.Subscriber(f"tcp://127.0.0.1:{port}", rcvhwm=200_000)
    pub.recv()
    rng = random.Random(0)
    tokens = np.zeros((3, 2), np.int64).tobytes()
    good = encode_envelope(b"run", b"layers.1.resid_post", 1, 1, 7, 1, 4, tokens, b"\0" * 32)
    at = len(b"layers.1.resid_post") + 1
    members = [(b"layers.1.resid_post", 0, b"\0" * 32), (b"layers.2.resid_post", 0, b"\1" * 32)]
    group = encode_group(b"run", 1, 1, 7, 4, tokens, members)
    fields = decode_group(memoryview(group))  # (site, layer, phase, step, run, dtype, hidden, n, tokens, payload, ...)
    assert [(f[0], f[1], f[3], bytes(f[9])) for f in fields] == [
        ("layers.1.resid_post", 1, 7, b"\0" * 32), ("layers.2.resid_post", 2, 7, b"\1" * 32)]

    def lying_group() -> bytes:  # a group whose header or members lie, inside a well-framed bundle
        count_at = GROUP.size - 10
        body = rng.choice([
            group[: rng.randrange(1, len(group) - 1)],  # truncated
            group[:count_at] + rng.choice([0, 3, 65535]).to_bytes(2, "little") + group[count_at + 2 :],  # count
            group[:17] + (2**32 - 1).to_bytes(4, "little") + group[21:],  # absurd hidden
            group + rng.randbytes(rng.randrange(1, 9)),  # bytes after the last member
            group[:-60] + bytes([rng.choice([0, 60, 255])]) + group[-59:],  # the last member's name length lies
            group[:5] + (VERSION + 1).to_bytes(2, "little") + group[7:],  # another version
        ])
        return encode_bundle([body])

    def hostile(i: int) -> list[bytes]:
        kind = i % 10
        if kind == 8 and i % 20 == 18:
            return [lying_group()]
        if kind == 0:
            return [rng.randbytes(rng.randrange(1, 200))]
        if kind == 1:
            return [good[: rng.randrange(0, len(good) - 1)]]
        if kind == 2:  # any version but ours
            version = rng.randrange(65535)
            version += version >= VERSION
            return [good[: at + 4] + version.to_bytes(2, "little") + good[at + 6 :]]
        if kind == 3:  # absurd n_tokens / hidden: must be refused before anything is allocated
            head = HEADER.pack(MAGIC, VERSION, 1, 1, 7, 1, 2**32 - 1, 2**32 - 1, 3, 19, 0, 0)
            return [good[:at] + head + good[at + HEADER.size :]]
        if kind == 4:
            return [good, rng.randbytes(rng.randrange(0, 64))]
        if kind == 5:
            return [b"layers.%d.%s" % (rng.randrange(10**7), rng.randbytes(4).hex().encode()) + good[at - 1 :]]
        if kind == 6:  # a zero byte first, like control topics, but not one of them
            return [b"\x00" + rng.randbytes(rng.randrange(0, 40)).replace(b"probebus/", b"")]
        if kind == 8:  # a bundle whose framing lies: truncated, a zero or absurd entry length, nothing inside
            body = encode_bundle([good, good])[len(BUNDLE_TOPIC):]
            cut = rng.choice([c for c in range(len(body) - 1) if c != 4 + len(good)])  # not between entries
            return [BUNDLE_TOPIC + rng.choice([body[:cut],
                                               (0).to_bytes(4, "little") + body,
                                               (2**32 - 1).to_bytes(4, "little") + good])]
        if kind == 9:  # a well-framed bundle of one capture that is not one
            return [encode_bundle([good[: at + 4] + (VERSION + 1).to_bytes(2, "little") + good[at + 6 :]])]
        return [good, good, good]

    before = _rss_mb()
    sent = 0
    for i in range(100_000):
        pub.send_multipart(hostile(i))
        sent += 1
        if i % 5000 == 4999:  # drain as we go so ZeroMQ's own queues stay small
            while sub.recv(timeout=0.05) is not None:
                pass
    while sub.recv(timeout=0.5) is not None:
        pass
    grew = _rss_mb() - before
    st = sub.stats
    assert st.received == 0 and st.malformed == sent, (st.malformed, sent, st.errors)
    assert set(st.errors) <= set(ERROR_KINDS) and len(st.errors) <= len(ERROR_KINDS)
    assert grew < 50, f"RSS grew by {grew:.0f} MB"
    sub.close()
    pub.close(0)


def test_one_subscriber_on_two_publishers_ends_after_both() -> None:
    """Like the stages of a pipeline-parallel vLLM engine: one stream per stage, one Subscriber."""
    a, b = build("llama"), build("qwen2")
    sa, sb = probe.attach(a, "layers.0.resid_post"), probe.attach(b, "layers.1.resid_post")
    sub = probe.Subscriber([sa.endpoint, sb.endpoint])
    sa.wait_for(sub, timeout=10)
    sb.wait_for(sub, timeout=10)
    _forward(a, 2)
    sa.close()
    first = [sub.recv(timeout=5) for _ in range(2)]
    assert all(c is not None for c in first) and sub.recv(timeout=0.5) is None and not sub.ended
    _forward(b, 3)
    sb.close()
    rest = list(sub.iter(idle_timeout=5))
    assert len(rest) == 3 and sub.ended and sub.stats.missed == 0
    assert sub.end_counts == {"layers.0.resid_post": 2, "layers.1.resid_post": 3}


def test_a_subscriber_that_reconnects_in_a_loop_does_not_keep_a_closed_session_open(tmp_path: Path) -> None:
    """A drain that opens a new Subscriber as soon as one ends gets each repeat of the end of stream and
    re-subscribes: a session waits for the subscribers present at close only (it used to wait its whole linger)."""
    model = build("llama")
    loop = ("import sys, probe\nwhile True:\n    s = probe.Subscriber(sys.argv[1])\n    for c in s:\n        pass\n"
            "    s.close()\n")
    endpoint = f"ipc://{tmp_path}/bus"  # one endpoint for the three sessions
    drain = subprocess.Popen([sys.executable, "-c", loop, endpoint])
    try:
        for _ in range(3):
            with probe.attach(model, "layers.*.resid_post", endpoint=endpoint) as session:
                assert session.wait_for_subscribers(1, timeout=30)
                with torch.no_grad():
                    model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
            t0 = time.monotonic()
            assert session.join(20), "the end of stream was never acknowledged"
            assert time.monotonic() - t0 < 10
    finally:
        drain.kill()
        drain.wait()


PINNED = textwrap.dedent("""
    import json, os, sys, time
    from probe._publisher import Publisher
    from probe.vllm._worker import spare_cpus
    os.sched_setaffinity(0, {0})  # as a vLLM CPU worker binds itself to its OpenMP core
    before = set(os.listdir("/proc/self/task"))
    cpus = spare_cpus() if sys.argv[1] == "spare" else {4096} if sys.argv[1] == "bogus" else None
    pub = Publisher("tcp://127.0.0.1:*", run="r", policy="complete", sndhwm=64, curve_secret_key=None,
                    stall_timeout=1.0, io_cpus=cpus)
    deadline = time.monotonic() + 20
    while True:  # libzmq's threads set their affinity, then their name, once running: under load that comes later
        threads = {}
        for tid in set(os.listdir("/proc/self/task")) - before:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            threads[f"{name}:{tid}"] = sorted(os.sched_getaffinity(int(tid)))
        if sum(n.startswith("ZMQbg/") for n in threads) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    pub.close({}, 1.0)
    print(json.dumps({"spare": sorted(cpus or ()), "threads": threads}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux thread affinity and two cores")
def test_bus_threads_leave_the_core_a_vllm_worker_is_pinned_to() -> None:
    """A vLLM CPU worker binds every thread it starts to its OpenMP cores; the bus's I/O and control
    threads go to the cores the parent may use and the worker does not, and stay put when told nothing."""
    out = {}
    for mode in ("spare", "none", "bogus"):
        run = subprocess.run([sys.executable, "-c", PINNED, mode], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr  # libzmq aborts the process on an affinity with no usable core
        out[mode] = json.loads(run.stdout)
        out[mode]["stderr"] = run.stderr
    spare = out["spare"]["spare"]
    assert spare == sorted(os.sched_getaffinity(0) - {0})
    moved = out["spare"]["threads"]
    assert any(name.startswith("ZMQbg/IO") for name in moved) and len(moved) >= 3  # I/O, reaper, control
    assert all(cpus == spare for cpus in moved.values()), moved
    assert all(cpus == [0] for cpus in out["none"]["threads"].values()), out["none"]  # the negative control
    assert "io_cpus [4096] are not cores this process may use" in out["bogus"]["stderr"]
    assert all(cpus == [0] for cpus in out["bogus"]["threads"].values()), out["bogus"]


def _type_confused_frames() -> list[bytes]:
    """Control frames that are valid JSON of the wrong shape: each raised out of Subscriber.recv once."""
    from probe._wire import END_TOPIC, INFO_TOPIC, REQUESTS_TOPIC

    deep = b"[" * 100_000 + b"]" * 100_000  # RecursionError in the JSON decoder
    good_info = {"run": "r", "endpoint": "e", "pid": 1}
    bodies = [
        (INFO_TOPIC, deep), (END_TOPIC, deep), (REQUESTS_TOPIC, deep),
        (INFO_TOPIC, {**good_info, "requests": [1, 2]}),  # a list where a map is expected
        (INFO_TOPIC, {**good_info, "counts": [1]}),
        (INFO_TOPIC, {**good_info, "counts": {"layers.0.resid_post": 1e400}}),  # OverflowError
        (INFO_TOPIC, {**good_info, "sites": "layers.0.resid_post"}),  # a string where a list is expected
        (INFO_TOPIC, {**good_info, "pid": [1], "run": {"a": 1}, "started": "yesterday"}),
        (INFO_TOPIC, {**good_info, "requests": {"0": {"seq_id": 0, "request_id": "a", "first_position": 1e400}}}),
        (END_TOPIC, {"counts": {"layers.0.resid_post": 1e400}}),
        (END_TOPIC, {"counts": {"layers.0.resid_post": [3]}}),
        (END_TOPIC, {"counts": {"layers.0.resid_post": -5}}),
        (END_TOPIC, {"counts": {"layers.0.resid_post": True}}),
        (REQUESTS_TOPIC, {"requests": [1]}),
        (REQUESTS_TOPIC, {"requests": {"0": [1]}}),
        (REQUESTS_TOPIC, {"requests": {"0": {"seq_id": 0}}, "recomputed": 1e400}),
        (REQUESTS_TOPIC, {"requests": {"1e400": {"seq_id": 0}}}),
    ]
    frames = [topic + (body if isinstance(body, bytes) else json.dumps(body).encode()) for topic, body in bodies]
    return [*frames, END_TOPIC + b'{"counts": {"layers.0.resid_post": 1e400}}']


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_type_confused_control_frames_are_counted_and_skipped_by_a_subscriber_a_recorder_and_top(
        tmp_path: Path) -> None:
    """Valid JSON of the wrong types (a list for a map, 1e400, deep nesting) in info, end and request frames: a
    Subscriber counts each as malformed and goes on, a recorder (`probebus record --endpoint`) records the good
    captures and ends cleanly, `probebus top` reports and exits 0; none of them takes a bad end of stream for the
    end. Before, each raised out of `recv` (AttributeError, OverflowError, RecursionError)."""
    from probe._wire import DTYPE_CODE, END_TOPIC, INFO_TOPIC, PRESENCE, encode_control

    endpoint = f"ipc://{tmp_path}/hostile.sock"
    pub = zmq.Context.instance().socket(zmq.XPUB)
    pub.bind(endpoint)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    cli = [sys.executable, "-m", "probebus"]
    record = subprocess.Popen([*cli, "record", "--endpoint", endpoint, "--out", str(tmp_path / "rec"), "--json",
                               "--duration", "120"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    top = subprocess.Popen([*cli, "top", endpoint, "--json", "--duration", "120", "--interval", "0.2"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sub = probe.Subscriber(endpoint)
    try:
        present: set[bytes] = set()
        deadline = time.monotonic() + 180  # two processes importing torch on a loaded machine
        while len(present) < 3 and time.monotonic() < deadline:  # each subscribes to its presence topic last
            if pub.poll(100):
                msg = pub.recv()
                if msg[1:].startswith(PRESENCE):
                    (present.add if msg[0] == 1 else present.discard)(msg[1:])
        assert len(present) == 3, (record.poll(), top.poll())
        site = b"layers.0.resid_post"
        pub.send(encode_control(INFO_TOPIC, {"run": "r", "endpoint": endpoint, "pid": 1, "sites": [site.decode()]}))
        hostile = _type_confused_frames()
        for frame in hostile:
            pub.send(frame)
        tokens = np.zeros((3, 1), np.int64).tobytes()
        for i in range(3):
            pub.send(encode_envelope(b"r", site, 1, DTYPE_CODE[torch.float32], i + 1, 0, 4, tokens,
                                     np.full(4, i, np.float32).tobytes(), seq=i))
        caps = [sub.recv(timeout=10) for _ in range(3)]
        assert [c and c.step for c in caps] == [1, 2, 3] and not sub.ended
        assert sub.stats.malformed == len(hostile) and sub.info is not None and sub.info.sites == [site.decode()]
        end = encode_control(END_TOPIC, {"run": "r", "endpoint": endpoint, "counts": {site.decode(): 3}})
        while present and time.monotonic() < deadline:  # repeated until each has acknowledged it
            pub.send(end)
            assert sub.recv(timeout=0.1) is None  # this process's subscriber reads it here
            while pub.poll(200):
                msg = pub.recv()
                if msg[1:].startswith(PRESENCE) and msg[0] == 0:
                    present.discard(msg[1:])
        assert not present, (record.poll(), top.poll(), sub.ended)
        rec_out, rec_err = record.communicate(timeout=60)
        top_out, top_err = top.communicate(timeout=60)
    finally:
        for p in (record, top):
            p.kill()
        sub.close()
        pub.close(0)
    assert sub.ended and sub.stats.received == 3 and sub.stats.missed == 0
    assert record.returncode == 0 and "Traceback" not in rec_err, rec_err
    assert json.loads(rec_out)["rows"] == 3, rec_out
    manifest = json.loads((tmp_path / "rec" / "_manifest.json").read_text())
    assert manifest["state"] != "failed" and not manifest.get("error"), manifest
    assert top.returncode == 0 and "Traceback" not in top_err, top_err
    totals = json.loads(top_out)
    assert totals["ended"] and totals["captures"] == 3 and totals["malformed"] >= len(hostile), totals


def test_a_late_joiner_counts_nothing_missed_that_was_published_before_it_joined() -> None:
    """Joining a session that is stepping, a subscriber may receive captures before the session info (ZeroMQ's I/O
    thread applies its subscription before the model's thread reads it and sends the info): it used to count every
    capture published before it joined as missed (a recorder reported "lost N (missed on the bus N)" with no hole
    in its data). Each of 6 joiners here receives an unbroken run of seqs per site and counts 0 missed."""
    model = build("llama")
    stop = threading.Event()
    with probe.attach(model, "layers.*.resid_post", max_delay=0) as session:
        def step() -> None:
            with torch.no_grad():
                while not stop.is_set():
                    model(torch.tensor([[5, 6, 7, 8]]))
                    time.sleep(0.001)

        stepper = threading.Thread(target=step)
        stepper.start()
        try:
            while session.step < 20:
                time.sleep(0.01)
            results = []
            for _ in range(6):
                sub = probe.Subscriber(session.endpoint)
                seqs: dict[str, list[int]] = {}
                deadline = time.monotonic() + 0.7
                while time.monotonic() < deadline:
                    cap = sub.recv(timeout=0.1)
                    if cap is not None:
                        seqs.setdefault(cap.site, []).append(cap.seq)
                sub.close()
                results.append((sub.stats.missed, seqs))
        finally:
            stop.set()
            stepper.join(30)
    for missed, seqs in results:
        assert seqs and missed == 0, [(m, {k: (v[0], len(v)) for k, v in s.items()}) for m, s in results]
        assert all(v == list(range(v[0], v[0] + len(v))) for v in seqs.values())  # nothing really lost either
