"""Decode overhead of probebus versus no probes and a naive synchronous-send baseline,
plus bus throughput against raw pyzmq with the same message sizes.

    python benchmarks/overhead.py                 # full run (~100M Llama, 5 repeats)
    python benchmarks/overhead.py --quick         # smoke run on a small model

Decode throughput is measured with a streamer that timestamps every new token, so the
prefill is excluded; modes are interleaved (rotating order) and medians are reported.
Subscribers run in separate processes and drain everything, like a real consumer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np
import torch
import zmq
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

import probe
from probe._context import StepContext

DRAIN = textwrap.dedent("""
    import sys, zmq, probe
    mode, endpoint = sys.argv[1], sys.argv[2]
    if mode == "probebus":          # one Subscriber per session; it ends at end-of-stream
        while True:
            sub = probe.Subscriber(endpoint)
            for cap in sub:
                pass
            sub.close()
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b""); s.connect(endpoint)
    while True:
        s.recv_multipart(copy=False)
""")


class Clock(BaseStreamer):
    """Timestamps each generated token; decode time excludes the prefill."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def intervals(self) -> list[float]:
        """Seconds between consecutive decode tokens (prefill excluded)."""
        return [b - a for a, b in zip(self.times[1:-1], self.times[2:], strict=True)]

    def decode_tok_s(self, batch: int) -> float:
        # times[0]: prompt pushed; times[1]: first token (after prefill); then one per decode step.
        steps = len(self.times) - 2
        return batch * steps / (self.times[-1] - self.times[1])


def build_model(quick: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    if quick:
        cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=8192)
    else:  # ~100M parameters
        cfg = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                          num_key_value_heads=12, vocab_size=16000, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


class NaiveHooks:
    """What most tools do: clone inside the hook and send synchronously, whole padded tensor."""

    def __init__(self, model: LlamaForCausalLM, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.bind(endpoint)
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            self.handles.append(layer.register_forward_hook(self._hook(f"layers.{i}.resid_post")))

    def _hook(self, site: str):  # noqa: ANN202
        def hook(module, args, output):  # noqa: ANN001, ANN202
            t = output.detach().clone()
            header = json.dumps({"site": site, "shape": list(t.shape), "dtype": str(t.dtype)}).encode()
            self.sock.send_multipart([site.encode(), header, t.numpy()])
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.sock.close(1000)


def run_decode(model, ids, mode: str, endpoints: dict[str, str]) -> Clock:  # noqa: ANN001
    clock = Clock()
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, streamer=clock,
              eos_token_id=None, pad_token_id=0)
    if mode == "none":
        with torch.no_grad():
            model.generate(ids, **kw)
    elif mode == "probebus":
        with probe.attach(model, "layers.*.resid_post", endpoint=endpoints["probebus"]) as session:
            session.wait_for_subscribers(1, timeout=30)
            with torch.no_grad():
                model.generate(ids, **kw)
        assert session.stats.dropped == 0
    else:
        naive = NaiveHooks(model, endpoints["naive"])
        time.sleep(0.3)  # PUB/SUB slow joiner
        with torch.no_grad():
            model.generate(ids, **kw)
        naive.close()
    return clock


def decode_overhead() -> None:
    model = build_model(args.quick)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: random Llama {params:.0f}M params, fp32, {torch.get_num_threads()} threads, "
          f"prompt {args.prompt}, {args.new_tokens} new tokens")
    endpoints = {"probebus": f"tcp://127.0.0.1:{args.port}", "naive": f"tcp://127.0.0.1:{args.port + 1}"}
    children = [subprocess.Popen([sys.executable, "-c", DRAIN, m, e]) for m, e in endpoints.items()]
    try:
        for batch in args.batches:
            ids = torch.randint(3, model.config.vocab_size, (batch, args.prompt))
            modes = ["none", "probebus", "naive"]
            run_decode(model, ids, "none", endpoints)  # warm-up
            got: dict[str, list[float]] = {m: [] for m in modes}
            steps: dict[str, list[float]] = {m: [] for m in modes}
            for rep in range(args.repeats):
                for m in modes[rep % 3:] + modes[: rep % 3]:
                    clock = run_decode(model, ids, m, endpoints)
                    got[m].append(clock.decode_tok_s(batch))
                    steps[m].extend(clock.intervals())
            # Two views: median run throughput, and the median per-token step time over every
            # token of every run (robust to bursts of load from outside the VM).
            med = {m: statistics.median(v) for m, v in got.items()}
            step = {m: batch / statistics.median(v) for m, v in steps.items()}
            print(f"\nbatch {batch}: decode tok/s, {args.repeats} interleaved repeats")
            for m in modes:
                spread = f"[{min(got[m]):.1f}..{max(got[m]):.1f}]"
                slow_run, slow_step = 100 * (1 - med[m] / med["none"]), 100 * (1 - step[m] / step["none"])
                print(f"  {m:9s} run median {med[m]:7.1f} tok/s {spread:>15s} ({slow_run:+5.1f}%)"
                      f"   per-token median {step[m]:7.1f} tok/s ({slow_step:+5.1f}%)")
            for name, v in (("run median", med), ("per-token median", step)):
                pb, nv = 1 - v["probebus"] / v["none"], 1 - v["naive"] / v["none"]
                ratio = f"{nv / pb:.1f}x" if pb > 0 else "probebus overhead not measurable (<= 0)"
                print(f"  {name}: naive overhead / probebus overhead = {ratio}")
    finally:
        for c in children:
            c.kill()


def bus_throughput() -> None:
    """Messages through hook-staging -> publisher -> Subscriber (other process), vs raw pyzmq PUB -> SUB."""
    sizes = [(1, 768), (8, 768), (128, 768), (1024, 768)]  # decode b1, decode b8, prefill 128, prefill 8x128
    print("\nbus throughput (fp32 [rows, 768] payloads), median of", args.repeats, "interleaved repeats")
    recv_script = textwrap.dedent("""
        import sys, time, zmq, probe
        mode, endpoint, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
        if mode == "probebus":
            sub = probe.Subscriber(endpoint)
            recv = lambda: sub.recv()
        else:
            s = zmq.Context.instance().socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b""); s.connect(endpoint)
            recv = lambda: s.recv_multipart(copy=False)
        recv(); t0 = time.perf_counter()
        for _ in range(count - 1):
            recv()
        print(time.perf_counter() - t0, flush=True)
    """)
    for rows, hidden in sizes:
        nbytes = rows * hidden * 4
        count = max(200, min(20000, int(300e6 / nbytes)))
        res: dict[str, list[float]] = {"probebus": [], "raw pyzmq": []}
        for rep in range(args.repeats):
            for mode in (["probebus", "raw pyzmq"] if rep % 2 == 0 else ["raw pyzmq", "probebus"]):
                res[mode].append(_one_throughput(mode, recv_script, rows, hidden, count))
        med = {m: statistics.median(v) for m, v in res.items()}
        ratio = med["probebus"] / med["raw pyzmq"]
        print(f"  {nbytes / 1024:8.0f} KiB x {count:5d}: probebus {med['probebus']:8.0f} msg/s "
              f"({med['probebus'] * nbytes / 1e9:5.2f} GB/s)  raw {med['raw pyzmq']:8.0f} msg/s "
              f"({med['raw pyzmq'] * nbytes / 1e9:5.2f} GB/s)  ratio {ratio:.2f}")


def _one_throughput(mode: str, script: str, rows: int, hidden: int, count: int) -> float:
    payload = torch.randn(1, rows, hidden)
    if mode == "probebus":
        session = probe.attach(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(1, 1)])),
                               "layers.0.resid_post", endpoint="tcp://127.0.0.1:*")
        endpoint = session.endpoint
        child = subprocess.Popen([sys.executable, "-c", script, mode, endpoint, str(count)], stdout=subprocess.PIPE)
        session.wait_for_subscribers(1, timeout=30)
        session._ctx = StepContext(1, 1, 1, rows, torch.ones(1, rows, dtype=torch.bool), torch.tensor([0]),
                                   torch.arange(rows).unsqueeze(0), torch.zeros(1, rows, dtype=torch.long),
                                   payload.device)
        for _ in range(count):  # exactly what a forward hook does per capture
            session._capture(("layers.0.resid_post", b"layers.0.resid_post", 0), payload)
        session.close()
    else:
        sock = zmq.Context.instance().socket(zmq.XPUB)
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
        child = subprocess.Popen([sys.executable, "-c", script, mode, endpoint, str(count)], stdout=subprocess.PIPE)
        sock.recv()
        data = payload.numpy()
        for _ in range(count):
            while True:
                try:
                    sock.send(data, zmq.NOBLOCK, copy=data.nbytes < zmq.COPY_THRESHOLD)
                    break
                except zmq.Again:
                    time.sleep(0.0002)
        out = child.communicate()[0]
        sock.close(5000)
        return (count - 1) / float(out)
    return (count - 1) / float(child.communicate()[0])


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, pyzmq {zmq.__version__} "
            f"(libzmq {zmq.zmq_version()}), numpy {np.__version__}, Python {platform.python_version()}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model, few tokens: a smoke run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=47810)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-bus", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.prompt, args.new_tokens = min(args.repeats, 2), 32, 16
    torch.set_num_threads(args.threads)
    print("machine:", machine())
    if not args.skip_decode:
        decode_overhead()
    if not args.skip_bus:
        bus_throughput()
