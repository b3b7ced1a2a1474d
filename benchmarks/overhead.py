"""What observing costs the model: probebus against plain generate, naive hooks and nnsight,
plus bus throughput against raw pyzmq with the same message sizes.

    python benchmarks/overhead.py                       # both placements, batch 1 and 8, 7 repeats
    python benchmarks/overhead.py --quick               # smoke run
    python benchmarks/overhead.py --skip-decode         # bus throughput only

Placements:
  model-core  the model's thread alone on core 0 with 1 torch thread while it generates;
              every other thread and process (ZeroMQ I/O, subscribers) on the other cores:
              a server with a spare core.
  shared      every thread on every core, 2 torch threads.
Modes (all in the same process, interleaved in rotating order, fresh per run):
  plain     generate with nothing attached (the baseline)
  empty     a forward hook per site that does nothing (the dispatch floor)
  probebus  probe.attach on the sites, a Subscriber process draining everything (not live: the
            session may hold steps up to its max_delay to send them together)
  probebus-live  the same with a live Subscriber (`live=True`, as a drafter): every step's
            captures leave at its end
  naive     hooks that clone and send synchronously with pyzmq, a SUB process draining
  nnsight   nnsight's generate, saving every site at every step (tracer.all())
Decode throughput excludes the prefill: a streamer timestamps every new token.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import textwrap
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import zmq
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

import probe
from probe._endpoint import bind_address, remove_private
from probe._publisher import MAX_DELAY_S

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import bootstrap_median  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def private_ipc() -> str:
    """A session's default endpoint (`bind_address`: ipc:// in a 0700 folder, only this user can connect), made here
    so that a drain can connect before the session binds; the folder goes when the process exits (a fixed path in
    /tmp left a socket file behind every run)."""
    endpoint, folder = bind_address(None, allow_remote=False)
    atexit.register(remove_private, folder)
    return endpoint


DRAIN = textwrap.dedent("""
    import sys, zmq, probe
    mode, endpoint = sys.argv[1], sys.argv[2]
    if mode.startswith("probebus"):  # one Subscriber per session; it ends at end-of-stream
        while True:
            sub = probe.Subscriber(endpoint, live=mode == "probebus-live")
            for cap in sub:
                pass
            sub.close()
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b""); s.connect(endpoint)
    while True:
        s.recv_multipart(copy=False)
""")


class Clock(BaseStreamer):
    """Timestamps each generated token; decode time excludes the prefill. `put` runs on the model's thread, so
    it also reads that thread's CPU time: wall minus CPU is the time the thread was not running (waiting, or its
    virtual CPU descheduled by the hypervisor: Linux's thread CPU time leaves out steal)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        self.cpu.append(time.thread_time())

    def end(self) -> None:
        pass

    def decode_tok_s(self, batch: int) -> float:
        # times[0]: prompt pushed; times[1]: first token (after prefill); then one per decode step.
        return batch * (len(self.times) - 2) / (self.times[-1] - self.times[1])

    def cpu_ms_per_step(self) -> float:
        """The model thread's CPU per decode step."""
        return 1e3 * (self.cpu[-1] - self.cpu[1]) / (len(self.cpu) - 2)

    def off_cpu_ms_per_step(self) -> float:
        """Wall minus the model thread's CPU, per decode step."""
        return 1e3 * (self.times[-1] - self.times[1]) / (len(self.times) - 2) - self.cpu_ms_per_step()

    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.times[1:-1], self.times[2:], strict=True)]


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=8192, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


class NaiveHooks:
    """What most tools do: clone inside the hook and send synchronously, the whole padded tensor."""

    def __init__(self, model: LlamaForCausalLM, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.bind(endpoint)
        self.handles = [layer.register_forward_hook(self._hook(f"layers.{i}.resid_post"))
                        for i, layer in enumerate(model.model.layers)]
        time.sleep(0.3)  # PUB/SUB slow joiner

    def _hook(self, site: str):
        def hook(module, args, output):
            t = (output[0] if isinstance(output, tuple) else output).detach().clone()
            header = json.dumps({"site": site, "shape": list(t.shape), "dtype": str(t.dtype)}).encode()
            self.sock.send_multipart([site.encode(), header, t.numpy()])
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.sock.close(1000)


@contextmanager
def model_core(pinned: bool):
    """Pin this (the model's) thread to core 0 while it generates; everything else stays on the rest."""
    if not pinned:
        yield
        return
    rest = set(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {0})  # on Linux, pid 0 = the calling thread only
    try:
        yield
    finally:
        os.sched_setaffinity(0, rest)


def run_once(model, lm, ids: torch.Tensor, mode: str, endpoints: dict[str, str], pinned: bool) -> Clock:
    clock = Clock()
    kw = dict(max_new_tokens=ARGS.new_tokens, min_new_tokens=ARGS.new_tokens, do_sample=False, streamer=clock,
              eos_token_id=None, pad_token_id=0)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        if mode == "plain":
            with model_core(pinned):
                model.generate(ids, attention_mask=mask, **kw)
        elif mode == "empty":
            hs = [layer.register_forward_hook(lambda m, a, o: None) for layer in model.model.layers]
            with model_core(pinned):
                model.generate(ids, attention_mask=mask, **kw)
            for h in hs:
                h.remove()
        elif mode in ("probebus", "probebus-live"):
            with probe.attach(model, "layers.*.resid_post", endpoint=endpoints[mode],
                              max_delay=ARGS.max_delay) as session:
                session.wait_for_subscribers(1, timeout=30)
                with model_core(pinned):
                    model.generate(ids, attention_mask=mask, **kw)
            assert session.stats.dropped == 0 and session.stats.published == session.stats.captured
            session.join(30)  # the drain has everything before the next run starts
        elif mode == "naive":
            naive = NaiveHooks(model, endpoints["naive"])
            with model_core(pinned):
                model.generate(ids, attention_mask=mask, **kw)
            naive.close()
        elif mode == "nnsight":
            saved = []
            with warnings.catch_warnings(), model_core(pinned):
                warnings.simplefilter("ignore")
                with lm.generate({"input_ids": ids, "attention_mask": mask}, **kw) as tracer:
                    for _ in tracer.all():
                        for layer in lm.model.layers:
                            saved.append(layer.output.save())
            assert len(saved) >= ARGS.new_tokens * len(model.model.layers)
    return clock


def decode_overhead(placement: str) -> None:
    pinned = placement == "model-core"
    cores = sorted(os.sched_getaffinity(0))
    if pinned and len(cores) < 2:
        print("model-core placement needs 2 cores; skipped")
        return
    torch.set_num_threads(1 if pinned else min(2, len(cores)))
    others = set(cores) - {0} if pinned else set(cores)
    os.sched_setaffinity(0, others)  # threads and processes started from here inherit the other cores
    model = build_model(ARGS)
    lm = None
    modes = [m for m in ARGS.modes if m != "nnsight" or _nnsight_ok()]
    if "nnsight" in modes:
        from nnsight import LanguageModel

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lm = LanguageModel(model, tokenizer=AutoTokenizer.from_pretrained(ROOT / "probebus/models/default"))
    endpoints = {"probebus": private_ipc(), "naive": f"tcp://127.0.0.1:{ARGS.port}", "probebus-live": private_ipc()}
    endpoints = {m: e for m, e in endpoints.items() if m in modes}
    children = [subprocess.Popen([sys.executable, "-c", DRAIN, m, e]) for m, e in endpoints.items()]
    zmq.Context.instance().socket(zmq.PAIR).close()  # ZeroMQ's global I/O thread starts here, on the other cores
    print(f"\n## placement {placement}: model thread on core{'s' if not pinned else ''} "
          f"{'0' if pinned else cores}, {torch.get_num_threads()} torch thread(s), everything else on "
          f"{sorted(others)}; random Llama {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
          f"(hidden {ARGS.hidden}, {ARGS.layers} layers, vocab 8192), fp32, prompt {ARGS.prompt}, "
          f"{ARGS.new_tokens} new tokens, greedy, sites layers.*.resid_post")
    try:
        for batch in ARGS.batches:
            ids = torch.randint(3, 8192, (batch, ARGS.prompt), generator=torch.Generator().manual_seed(batch))
            run_once(model, lm, ids, "plain", endpoints, pinned)  # warm-up
            clocks: dict[str, list[Clock]] = {m: [] for m in modes}
            for rep in range(ARGS.repeats):
                for m in modes[rep % len(modes):] + modes[: rep % len(modes)]:
                    clocks[m].append(run_once(model, lm, ids, m, endpoints, pinned))
            report(batch, clocks)
    finally:
        for c in children:
            c.kill()
        os.sched_setaffinity(0, set(cores))


def report(batch: int, clocks: dict[str, list[Clock]]) -> None:
    tok_s = {m: [c.decode_tok_s(batch) for c in v] for m, v in clocks.items()}
    base = statistics.median(tok_s["plain"])
    print(f"\nbatch {batch}: decode tok/s over {ARGS.repeats} interleaved runs (median [min..max]), "
          "slowdown = 1 - median / median(plain)")
    slow = {}
    for m, v in tok_s.items():
        med = statistics.median(v)
        slow[m] = 100 * (1 - med / base)
        # each run's slowdown against the plain run of the same round: the spread the VM's drift allows
        pairs = [100 * (1 - a / b) for a, b in zip(v, tok_s["plain"], strict=True)]
        paired = ""
        if m != "plain":
            lo, hi = bootstrap_median(pairs)
            paired = (f"   per-round [{min(pairs):+5.1f}..{max(pairs):+5.1f}] %, median of rounds "
                      f"{statistics.median(pairs):+5.1f} % (90 % interval {lo:+.1f}..{hi:+.1f})")
        print(f"  {m:13s} {med:8.1f} tok/s [{min(v):7.1f}..{max(v):7.1f}]  slowdown {slow[m]:+6.1f} %" + paired)
    if "probebus" in slow:
        others = ", ".join(f"{m} {slow[m]:+.1f} %" for m in ("probebus-live", "naive", "nnsight") if m in slow)
        print(f"  -> probebus {slow['probebus']:+.1f} % vs {others}")
    # The same runs split: the model thread's CPU per step (what the hooks and sends cost it), and the time it
    # was not running. On a VM the second includes the hypervisor's steal, e.g. while the thread's virtual CPU
    # wakes the other, idle one (an eventfd write to ZeroMQ's I/O thread, a socket write to a subscriber).
    cpu_base = statistics.median(c.cpu_ms_per_step() for c in clocks["plain"])
    print("  model thread per decode step, median: CPU ms (slowdown vs plain) | not running ms")
    for m, v in clocks.items():
        cpu = statistics.median(c.cpu_ms_per_step() for c in v)
        off = statistics.median(c.off_cpu_ms_per_step() for c in v)
        print(f"  {m:13s} CPU {cpu:7.2f} ms ({100 * (cpu / cpu_base - 1):+5.1f} %)   not running {off:6.2f} ms")


def _nnsight_ok() -> bool:
    try:
        import nnsight  # noqa: F401
    except ImportError:
        print("nnsight not installed (pip install -e '.[bench]'): its column is skipped")
        return False
    return True


RECV = textwrap.dedent("""
    import resource, sys, time, zmq, probe
    mode, endpoint, warm, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if mode == "probebus":
        sub = probe.Subscriber(endpoint)
        recv = lambda: sub.recv()
        print("ready", flush=True)
    else:
        s = zmq.Context.instance().socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b""); s.connect(endpoint)
        recv = lambda: s.recv_multipart(copy=False)
    for _ in range(warm):  # steady state: the sender's staging memory has been touched once
        recv()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for _ in range(count):
        recv()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)  # this process's CPU (I/O thread too) and page faults
    print(wall, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt, flush=True)
""")


class Echo(torch.nn.Module):
    """An 8-layer 'model' whose layers return their input: a forward is 8 captures of that tensor, like
    a step with probes on every residual stream (the per-step identity is shared by the 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Identity() for _ in range(8)])

    def forward(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor, past_key_values: Past) -> torch.Tensor:
        for layer in self.layers:
            inputs_embeds = layer(inputs_embeds)
        past_key_values.seen += input_ids.shape[1]
        return inputs_embeds


class Past:
    """All a KV cache tells the hooks: how many positions each row has before this step. A decode-sized
    capture is one step of a running decode (one new token per row after a prefill), as in `generate`."""

    def __init__(self) -> None:
        self.seen = 0

    def get_seq_length(self) -> int:
        return self.seen


def bus_throughput() -> None:
    # (batch, new tokens per row, hidden): decode b1, decode b8, prefill 128, prefill 8 x 128
    sizes = [(1, 1, 768), (8, 1, 768), (1, 128, 768), (8, 128, 768)]
    sizes = [s for s in sizes if ARGS.sizes is None or s[0] * s[1] * s[2] * 4 // 1024 in ARGS.sizes]
    torch.set_num_threads(1)
    print(f"\n## bus throughput: fp32 [rows, 768] captures through the hook path into a Subscriber in another "
          f"process, against raw pyzmq XPUB -> SUB (recv_multipart) of the same bytes, zero-copy of one buffer "
          f"(raw) and copied per message (raw copy); median of {ARGS.repeats} "
          "interleaved repeats")
    for batch, seq, hidden in sizes:
        rows = batch * seq
        nbytes = rows * hidden * 4
        count = 8 * (max(200, min(20000, int(300e6 / nbytes))) // 8) if not ARGS.quick else 304
        modes = ["probebus", "raw pyzmq", "raw copy"]
        res: dict[str, list[tuple[float, float, float, float]]] = {m: [] for m in modes}
        for rep in range(ARGS.repeats):
            for mode in modes[rep % 3:] + modes[: rep % 3]:  # rotating order
                res[mode].append(_one_throughput(mode, batch, seq, hidden, count))
        med = {m: [statistics.median(r[i] for r in v) for i in range(4)] for m, v in res.items()}
        lo, hi = min(r[0] for r in res["probebus"]), max(r[0] for r in res["probebus"])
        print(f"  {nbytes / 1024:6.0f} KiB x {count:5d}: probebus {med['probebus'][0]:8.0f} msg/s "
              f"({med['probebus'][0] * nbytes / 1e9:5.2f} GB/s) [{lo:.0f}..{hi:.0f}]"
              f"   raw {med['raw pyzmq'][0]:8.0f} msg/s ({med['raw pyzmq'][0] * nbytes / 1e9:5.2f} GB/s)"
              f"   ratio {med['probebus'][0] / med['raw pyzmq'][0]:.2f}"
              f"   | raw copy {med['raw copy'][0]:8.0f} msg/s, ratio {med['probebus'][0] / med['raw copy'][0]:.2f}")
        # On two cores both processes' CPU decides: per message, the sending process (its Python thread and
        # ZeroMQ I/O thread) and the receiving one, and the receiver's page faults.
        print("      CPU us/msg, sender / receiver (receiver page faults/msg): " + ";  ".join(
            f"{m} {med[m][1]:.1f} / {med[m][2]:.1f} ({med[m][3]:.0f})" for m in modes))


def _one_throughput(mode: str, batch: int, seq: int, hidden: int, count: int) -> tuple[float, float, float, float]:
    """(messages/s, sender CPU us/msg, receiver CPU us/msg, receiver page faults/msg) in steady state.

    The receiver starts its clock after a warm-up that is long
    enough for probebus to have touched its whole staging ring once (first-touch page faults cost ~8x
    a copy into mapped memory here: a one-off cost of a new session, not of a running bus). One new
    token per row is a decode step after a prefill; more is a prefill of a new batch each step."""
    payload = torch.randn(batch, seq, hidden)
    ids = torch.full((batch, seq), 5, dtype=torch.long)
    nbytes = payload.numel() * 4
    warm = 8 * -(-max(2000 if nbytes < (64 << 10) else 0, (64 << 20) // nbytes + 16) // 8)
    args = [str(warm), str(count)]
    if mode == "probebus":
        model = Echo()
        with probe.attach(model, "layers.*.resid_post", endpoint="tcp://127.0.0.1:*",
                          max_delay=ARGS.max_delay) as session:
            child = subprocess.Popen([sys.executable, "-c", RECV, mode, session.endpoint, *args],
                                     stdout=subprocess.PIPE, text=True)
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            session.wait_for_subscribers(1, timeout=30)
            past = Past()
            for i in range((warm + count) // 8):
                if i == warm // 8:
                    c0 = _cpu()
                model(input_ids=ids, inputs_embeds=payload, past_key_values=past if seq == 1 else Past())
            session.flush()  # the last steps leave now, not a linger later: throughput, not the holding policy
            out = child.communicate()[0]
            sent = _cpu() - c0
        return _rates(out, sent, count)
    # "raw pyzmq" sends one buffer of its own with copy=False (pyzmq still copies below its 64 KiB
    # threshold) and never writes to it: the ceiling. "raw copy" is pyzmq's default send (copy=True), as a
    # sender must whose source memory is reused after the send (a model's activations): the same copies
    # as probebus makes, the fair comparison for what a bus of live tensors can reach.
    sock = zmq.Context.instance().socket(zmq.XPUB)
    sock.setsockopt(zmq.XPUB_NODROP, 1)
    endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    child = subprocess.Popen([sys.executable, "-c", RECV, mode, endpoint, *args], stdout=subprocess.PIPE)
    sock.recv()
    data = payload.numpy()
    for i in range(warm + count):
        if i == warm:
            c0 = _cpu()
        while True:
            try:
                sock.send(data, zmq.NOBLOCK, copy=mode == "raw copy" or data.nbytes < zmq.COPY_THRESHOLD)
                break
            except zmq.Again:
                time.sleep(0.0002)
    out = child.communicate()[0]
    sent = _cpu() - c0
    sock.close(5000)
    return _rates(out, sent, count)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rates(out: str | bytes, sender_cpu: float, count: int) -> tuple[float, float, float, float]:
    wall, cpu, faults = (float(x) for x in out.split())
    return count / wall, sender_cpu / count * 1e6, cpu / count * 1e6, faults / count


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, pyzmq {zmq.__version__} "
            f"(libzmq {zmq.zmq_version()}), numpy {np.__version__}, Python {platform.python_version()}, "
            f"probebus {probe.__version__}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repeats and tokens: a smoke run")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds per mode (default: %(default)s)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (default: 1 8)")
    ap.add_argument("--placements", nargs="+", default=["model-core", "shared"], choices=["model-core", "shared"])
    ap.add_argument("--modes", nargs="+", default=["plain", "empty", "probebus", "probebus-live", "naive", "nnsight"],
                    choices=["plain", "empty", "probebus", "probebus-live", "naive", "nnsight"])
    ap.add_argument("--hidden", type=int, default=512, help="model width (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (default: %(default)s)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (default: %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=48, help="tokens generated per run (default: %(default)s)")
    ap.add_argument("--port", type=int, default=47810, help="TCP port of the naive baseline")
    ap.add_argument("--skip-decode", action="store_true", help="only the bus throughput")
    ap.add_argument("--max-delay", type=float, default=MAX_DELAY_S,
                    help="probebus's max_delay: steps held for one send while no subscriber is live; 0 sends "
                         "every step at its end (default: %(default)s, as probe.attach)")
    ap.add_argument("--skip-bus", action="store_true", help="only the decode overhead")
    ap.add_argument("--sizes", type=int, nargs="+", choices=[3, 24, 384, 3072],
                    help="bus throughput payloads in KiB (default: all four)")
    ARGS = ap.parse_args()
    if "plain" not in ARGS.modes:
        ARGS.modes.insert(0, "plain")
    if ARGS.quick:
        ARGS.repeats, ARGS.new_tokens = min(ARGS.repeats, 2), 12
    print("machine:", machine())
    if not ARGS.skip_decode:
        for placement in ARGS.placements:
            decode_overhead(placement)
    if not ARGS.skip_bus:
        bus_throughput()
