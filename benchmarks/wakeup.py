"""What one send costs the sending thread when the other core is asleep: this machine's cross-core wake-up.

    python benchmarks/wakeup.py                 # ~1 min
    python benchmarks/wakeup.py --sends 400 --gap-ms 20

A thread pinned to core 0 sends a 32 KiB pyzmq message to a subscriber process on core 1,
once every `--gap-ms` (so ZeroMQ's I/O thread and the subscriber go back to sleep between
sends, as between a model's decode steps), and times each send: wall clock, and the
thread's own CPU time. Three conditions, interleaved in rounds:

  idle gap     the send after a pause: it wakes ZeroMQ's I/O thread on core 1 (an eventfd
               write), which wakes the subscriber;
  busy core 1  the same while a `nice 19` spinner keeps core 1 running, so no core is idle;
  back to back sends with no pause: the I/O thread is still awake.

On bare metal a wake-up costs the sender microseconds. On a VM, waking a virtual CPU that
is idle goes through the hypervisor, and the sending thread's virtual CPU can stall with
it: the stall shows as wall time that is neither the thread's CPU time nor a context
switch (Linux leaves the hypervisor's steal out of a thread's CPU time). That is what a
probed model pays per burst its thread hands to ZeroMQ, so this figure tells how much
holding steps (`max_delay`) is worth on the machine at hand.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np
import zmq

SUB = textwrap.dedent("""
    import os, sys, zmq
    os.sched_setaffinity(0, {1})
    s = zmq.Context.instance().socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b""); s.connect(sys.argv[1])
    print("ready", flush=True)
    while True:
        s.recv(copy=False)
""")
SPIN = "import os\nos.nice(19)\nos.sched_setaffinity(0, {1})\nwhile True: pass"


def timed_sends(sock: zmq.Socket, data: bytes, count: int, gap_s: float) -> list[tuple[float, float]]:
    """(wall us, thread CPU us) of each send, on this thread pinned to core 0."""
    out = []
    for _ in range(count):
        if gap_s:
            time.sleep(gap_s)
        w, c = time.perf_counter(), time.thread_time()
        sock.send(data, copy=True)
        out.append(((time.perf_counter() - w) * 1e6, (time.thread_time() - c) * 1e6))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sends", type=int, default=150, help="sends per condition and round (default: %(default)s)")
    ap.add_argument("--gap-ms", type=float, default=20.0, help="pause before each idle-gap send (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs 2 cores")
    os.sched_setaffinity(0, {1})  # ZeroMQ's I/O thread and the processes started here land on core 1
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.XPUB_NODROP, 1)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sub = subprocess.Popen([sys.executable, "-c", SUB, f"tcp://127.0.0.1:{port}"], stdout=subprocess.PIPE, text=True)
    assert sub.stdout is not None and sub.stdout.readline().strip() == "ready"
    sock.recv()  # its subscription
    os.sched_setaffinity(0, {0})  # this thread only, from here: the "model's" thread
    data = np.random.default_rng(0).bytes(32 << 10)
    res: dict[str, list[tuple[float, float]]] = {"idle gap": [], "busy core 1": [], "back to back": []}
    try:
        for _ in range(args.rounds):
            res["idle gap"] += timed_sends(sock, data, args.sends, args.gap_ms / 1e3)
            spin = subprocess.Popen([sys.executable, "-c", SPIN])
            time.sleep(0.3)
            res["busy core 1"] += timed_sends(sock, data, args.sends, args.gap_ms / 1e3)
            spin.kill()
            spin.wait()
            res["back to back"] += timed_sends(sock, data, args.sends, 0.0)
    finally:
        sub.kill()
        sock.close(0)
    print(f"32 KiB pyzmq sends from a thread on core 0 to a subscriber on core 1, {args.rounds} rounds x "
          f"{args.sends}; gap {args.gap_ms} ms; us per send, median [p90] (max)")
    for name, v in res.items():
        wall = np.array([x[0] for x in v])
        cpu = np.array([x[1] for x in v])
        off = wall - cpu
        print(f"  {name:13s} wall {statistics.median(wall):7.1f} [{np.percentile(wall, 90):7.1f}] ({wall.max():7.0f})"
              f"   thread CPU {statistics.median(cpu):6.1f} [{np.percentile(cpu, 90):6.1f}]"
              f"   not running {statistics.median(off):7.1f} [{np.percentile(off, 90):7.1f}]")


if __name__ == "__main__":
    main()
