"""A vLLM session's request map on the bus: the whole map in the info, only new entries per step.

The publisher side is driven here directly (what `probe/vllm/_worker.py` does at a step's end),
so the main suite covers it without vLLM; tests/vllm_backend checks it against a real engine.
The subscriber runs in another process, on real sockets.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from probe._publisher import Publisher
from probe._wire import REQUESTS_TOPIC, encode_control

SUB = r"""
import json, sys, time, probe
sub = probe.Subscriber(sys.argv[1], rcvhwm=int(sys.argv[3]))
assert sub.wait_info(30) is not None
print("ready", flush=True)
if sys.argv[2] == "wait":  # not reading until told: a best-effort publisher drops at our pipe's high-water mark
    sys.stdin.readline()
for _ in sub:
    pass
print(json.dumps({"requests": {str(k): v for k, v in sub.info.requests.items()}, "backend": sub.info.backend,
                  "taken": [e["seq_id"] for e in sub.take_requests()], "recomputed": sub.info.recomputed}))
"""


class Worker:
    """The worker's half: a request map, an info built only when one is sent, and a delta per step."""

    def __init__(self, tmp_path, policy: str, sndhwm: int = 1000) -> None:
        self.entries: dict[str, dict] = {}
        self.builds = 0
        self.pub = Publisher(f"ipc://{tmp_path}/bus", run="r", policy=policy, sndhwm=sndhwm,
                             curve_secret_key=None, stall_timeout=5.0)
        self.pub.set_info(self.info, send=False)

    def info(self) -> dict:
        self.builds += 1
        return {"run": "r", "endpoint": self.pub.endpoint, "pid": 1, "backend": "vllm",
                "requests": dict(self.entries), "recomputed": 2}

    def start(self, ids: list[int], *, hold: bool = True) -> None:
        new = {str(i): {"seq_id": i, "request_id": f"req-{i}", "first_position": i % 3} for i in ids}
        self.entries.update(new)
        self.pub.send_control(encode_control(REQUESTS_TOPIC, {"run": "r", "requests": new, "recomputed": 2}),
                              hold=hold)

    def subscriber(self, pause: bool = False, rcvhwm: int = 1000) -> subprocess.Popen:
        """With `pause`, it stops reading after the info until a line on its stdin (`resume`)."""
        p = subprocess.Popen([sys.executable, "-c", SUB, self.pub.endpoint, "wait" if pause else "go", str(rcvhwm)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.pub.wait_until(lambda: len(self.pub.subscribers) >= 1, 30)
        assert p.stdout.readline().strip() == "ready"
        return p

    @staticmethod
    def resume(p: subprocess.Popen) -> None:
        p.stdin.write("go\n")
        p.stdin.flush()

    def finish(self, p: subprocess.Popen) -> dict:
        self.pub.close({"run": "r"}, 10.0)
        out, _ = p.communicate(timeout=60)
        self.pub.join(10.0)
        return json.loads(out)


def test_a_subscriber_gets_each_new_request_without_the_whole_map_again(tmp_path) -> None:
    w = Worker(tmp_path, "complete")
    w.start([0, 1])  # before anyone listens: in the info the subscriber gets when it joins
    p = w.subscriber()
    assert w.builds == 1
    w.start([2, 3])  # held with the step's bundles (no live subscriber) ...
    w.start([4], hold=False)  # ... and sent at once, after those held before it
    for i in range(5, 40):
        w.start([i])
    got = w.finish(p)
    assert got["requests"] == w.entries and len(w.entries) == 40
    assert sorted(got["taken"]) == list(range(40)) and got["backend"] == "vllm" and got["recomputed"] == 2
    assert w.builds == 1, "38 more requests started, and the whole map was never built again"


def test_a_lost_delta_brings_the_whole_map_again(tmp_path) -> None:
    """best_effort drops at a subscriber that stopped reading; the next delta shows the skipped seq_ids and
    the subscriber asks for the whole map (its presence again), so it ends up knowing every request."""
    w = Worker(tmp_path, "best_effort", sndhwm=2)
    p = w.subscriber(pause=True, rcvhwm=2)
    w.start([0], hold=False)
    with w.pub.lock:  # fill the pipes and the kernel's socket buffers while the subscriber does not read
        for _ in range(64):
            w.pub.sock.send(b"\x00probebus/filler " + bytes(1 << 20))
    w.start([1, 2], hold=False)  # lost at the subscriber's full pipe
    w.resume(p)  # it reads again (told, not timed: a slow start on a loaded machine must not end the pause early)
    for _ in range(5):  # [3] shows the gap; sent again while it may still meet a pipe the filler keeps full
        w.start([3], hold=False)
        deadline = time.monotonic() + 2
        while w.builds < 2 and time.monotonic() < deadline:  # the control thread answers the new presence
            time.sleep(0.05)
        if w.builds >= 2:
            break
    got = w.finish(p)
    if w.builds < 2:
        pytest.fail(f"the subscriber did not ask for the map again; it has {sorted(got['requests'])}")
    assert got["requests"] == w.entries and sorted(got["taken"]) == [0, 1, 2, 3]
