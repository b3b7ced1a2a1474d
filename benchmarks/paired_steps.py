"""What a probe costs one decode step, measured step against neighbouring step.

    python benchmarks/paired_steps.py                  # batch 1 and 8, 12 generates per mode
    python benchmarks/paired_steps.py --quick
    python benchmarks/paired_steps.py --compiled --default-model --modes a/a probebus

`overhead.py` compares whole generate calls, seconds apart, and on a shared VM their
per-round spread (10-20 %) hides a 2 % effect. Here the probe is switched on and off
between the decode steps of one generate: the taps come off the model entirely on an
"off" step (it runs as plain `generate` does) and go back on for the next. Each "on"
step is compared with the mean of the "off" steps on both sides of it, 15-30 ms apart,
which cancels the VM's drift and the steps' own growth with the sequence. The switch
itself happens between the timestamps, so it is not counted; what an "on" step pays
(hooks, copies, the step's identity, the sends that fall due at its end) is.

Modes, interleaved per generate: `a/a` switches nothing (the estimator's own bias, which
should be ~0), `probebus` (a draining Subscriber; steps held up to the linger, as by
default), `probebus-live` (a live Subscriber: every step's captures leave at its end),
`naive` (hooks that clone and send synchronously). The model's thread runs alone on
core 0 with 1 torch thread; everything else on the other cores (overhead.py's
"model core" placement). `--compiled`: `model.forward = torch.compile(model.forward, fullgraph=True)`
over a static KV cache (transformers' documented fast path); the taps' graph and the plain one are
both compiled by a warm-up generate per mode, and switching between them is a lookup in Dynamo's
cache. Reported: the median per-step cost (CPU of the model's thread,
and wall) as a share of an off step, with a 90 % bootstrap interval.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import zmq
from transformers import AutoModelForCausalLM, StaticCache
from transformers.generation.streamers import BaseStreamer

import probe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import bootstrap_median  # noqa: E402
from overhead import DRAIN, NaiveHooks, build_model, machine, model_core, private_ipc  # noqa: E402

MODES = ["a/a", "probebus", "probebus-live", "naive"]


class Toggler(BaseStreamer):
    """Records each decode step's wall and thread CPU time and the thread's minor page faults, and switches the
    probe for the next step between the timestamps (`put` runs on the model's thread after every step)."""

    def __init__(self, switch, first_on: bool, block: int = 1, settle: int = 0) -> None:
        self.switch, self.state, self.block, self.settle = switch, first_on, block, settle
        self.steps: list[tuple[bool, float, float, int]] = []  # (probed, wall s, cpu s, faults) per decode step
        self._puts = 0
        self._n = 0  # decode steps since the last switch
        self._t = (0.0, 0.0, 0)

    def put(self, value: torch.Tensor) -> None:
        wall, cpu, faults = time.perf_counter(), time.thread_time(), minor_faults()
        self._puts += 1
        if self._puts == 1:  # the prompt: the prefill follows, probed as usual
            return
        if self._puts > 2:  # a decode step just ended
            self._n += 1
            if self._n > self.settle:  # the first steps after a switch pay for the switch (see --settle)
                self.steps.append((self.state, wall - self._t[0], cpu - self._t[1], faults - self._t[2]))
            if self._n == self.block:
                self.state, self._n = not self.state, 0
        self.switch(self.state)
        self._t = (time.perf_counter(), time.thread_time(), minor_faults())

    def end(self) -> None:
        pass


def minor_faults() -> int:
    """The calling thread's minor page faults so far: a step that faults back in pages glibc returned to the
    kernel after the step before pays for each (docs/benchmarks.md, "the batch-8 slow mode was page faults")."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def costs(steps: list[tuple[bool, float, float]], field: int) -> tuple[list[float], list[float]]:
    """Per "on" step: its time minus the mean of the nearest "off" step before it and the nearest after it;
    and the off steps' times."""
    offs = [i for i, s in enumerate(steps) if not s[0]]
    diffs = []
    for i, s in enumerate(steps):
        before = [j for j in offs if j < i]
        after = [j for j in offs if j > i]
        if s[0] and before and after:
            diffs.append(s[field] - (steps[before[-1]][field] + steps[after[0]][field]) / 2)
    return diffs, [steps[j][field] for j in offs]


def report(batch: int, steps: dict[str, list[list]], cycle: float | None = None) -> None:
    """Per mode: the median cost of a probed step over its unprobed neighbours (CPU, wall) with its 90 %
    bootstrap interval, as a share of an unprobed step; and of `cycle` seconds (a step's start to the next's)."""
    print(f"\nbatch {batch}: cost of a probed decode step over its unprobed neighbours, median "
          "(90 % bootstrap interval), share of an unprobed step")
    for m, runs in steps.items():
        out = []
        for field, name in ((2, "CPU"), (1, "wall")):
            diffs, offs = [], []
            for s in runs:
                d, o = costs(s, field)
                diffs += d
                offs += o
            base = statistics.median(offs)
            lo, hi = bootstrap_median(diffs)
            out.append(f"{name} {1e3 * statistics.median(diffs):+7.3f} ms "
                       f"{100 * statistics.median(diffs) / base:+5.2f} % "
                       f"[{100 * lo / base:+.2f}..{100 * hi / base:+.2f}] of {1e3 * base:6.2f} ms")
        if cycle is not None:  # the wall cost against the whole cycle
            out.append(f"= {100 * statistics.median(diffs) / cycle:+5.2f} % of the engine's cycle")
        print(f"  {m:14s} {len(diffs):4d} steps   " + "   ".join(out))
        if all(len(step) > 3 for s in runs for step in s):  # (the minor page faults of each step)
            on = [step[3] for s in runs for step in s if step[0]]
            off = [step[3] for s in runs for step in s if not step[0]]
            print(f"  {'':14s} minor page faults a step, mean: probed {statistics.mean(on):.1f}, "
                  f"unprobed {statistics.mean(off):.1f}")


def run(model, ids: torch.Tensor, mode: str, endpoints: dict[str, str], first_on: bool,
        naive: NaiveHooks | None) -> list[tuple[bool, float, float]]:
    kw = dict(max_new_tokens=ARGS.new_tokens, min_new_tokens=ARGS.new_tokens, do_sample=False, eos_token_id=None,
              pad_token_id=0, attention_mask=torch.ones_like(ids))
    if ARGS.compiled:
        kw["cache"] = StaticCache(config=model.config, max_cache_len=ids.shape[1] + ARGS.new_tokens)
    if mode == "a/a":
        clock = Toggler(lambda on: None, first_on, ARGS.block, ARGS.settle)
        with torch.no_grad(), model_core(True):
            model.generate(ids, streamer=clock, **kw)
        return clock.steps
    if mode == "naive":
        assert naive is not None
        naive.handles = []
        hook = [naive._hook(f"layers.{i}.resid_post") for i in range(len(model.model.layers))]

        def switch_naive(on: bool) -> None:
            for h in naive.handles:
                h.remove()
            naive.handles = [layer.register_forward_hook(f) for layer, f in zip(model.model.layers, hook,
                                                                                  strict=True)] if on else []
        clock = Toggler(switch_naive, first_on, ARGS.block, ARGS.settle)
        switch_naive(True)
        with torch.no_grad(), model_core(True):
            model.generate(ids, streamer=clock, **kw)
        switch_naive(False)
        return clock.steps
    with probe.attach(model, "layers.*.resid_post", endpoint=endpoints[mode]) as session:
        hooks, sites = session._hooks, session.sites  # the taps on and off without pause()'s flush of held steps

        def switch(on: bool) -> None:
            hooks.change("add" if on else "remove", sites)
            assert on or probe._hooks.tapped(model) == 0  # an off step runs as plain generate
        session.wait_for_subscribers(1, timeout=30)
        clock = Toggler(switch, first_on, ARGS.block, ARGS.settle)
        with torch.no_grad(), model_core(True):
            model.generate(ids, streamer=clock, **kw)
    assert session.stats.dropped == 0 and session.stats.published == session.stats.captured
    session.join(30)
    return clock.steps


def main() -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("needs 2 cores: the model's thread alone on core 0, the rest on the others")
    torch.set_num_threads(1)
    os.sched_setaffinity(0, set(cores) - {0})  # threads and processes started from here stay off core 0
    if ARGS.default_model:
        from probebus.models import resolve_model

        model = AutoModelForCausalLM.from_pretrained(resolve_model("default"), dtype=torch.float32).eval()
    else:
        model = build_model(ARGS)
    model = model.to(ARGS.device, getattr(torch, ARGS.dtype))
    if ARGS.compiled:
        model.forward = torch.compile(model.forward, fullgraph=True, mode=ARGS.compile_mode)
    endpoints = {"probebus": private_ipc(), "probebus-live": private_ipc(),
                 "naive": f"tcp://127.0.0.1:{ARGS.port}"}
    children = [subprocess.Popen([sys.executable, "-c", DRAIN, m, e]) for m, e in endpoints.items()
                if m in ARGS.modes]
    zmq.Context.instance().socket(zmq.PAIR).close()  # ZeroMQ's I/O thread starts here, off core 0
    naive = NaiveHooks(model, endpoints["naive"]) if "naive" in ARGS.modes else None
    if naive is not None:
        for h in naive.handles:
            h.remove()
    print("machine:", machine())
    what = "the default model" if ARGS.default_model else f"random Llama (hidden {ARGS.hidden}, {ARGS.layers} layers)"
    how = f"compiled ({ARGS.compile_mode or 'default'} mode), static cache" if ARGS.compiled else "eager"
    print(f"{what} on {ARGS.device}, {how}, {ARGS.dtype}, prompt {ARGS.prompt}, "
          f"{ARGS.new_tokens} new tokens, greedy, sites layers.*.resid_post; model thread alone on core 0; "
          f"{ARGS.generates} generates per mode, the probe on and off every {ARGS.block} decode step(s)")
    try:
        for batch in ARGS.batches:
            ids = torch.randint(3, 8192, (batch, ARGS.prompt), generator=torch.Generator().manual_seed(batch))
            ids = ids.to(ARGS.device)
            run(model, ids, "a/a", endpoints, True, naive)  # warm-up
            if ARGS.compiled:  # every mode's graphs compiled before the clock starts
                for m in ARGS.modes:
                    run(model, ids, m, endpoints, True, naive)
            steps: dict[str, list[list]] = {m: [] for m in ARGS.modes}
            for g in range(ARGS.generates):
                for m in ARGS.modes[g % len(ARGS.modes):] + ARGS.modes[: g % len(ARGS.modes)]:
                    steps[m].append(run(model, ids, m, endpoints, g % 2 == 0, naive))
            report(batch, steps)
    finally:
        for c in children:
            c.kill()
        if naive is not None:
            naive.sock.close(0)
        os.sched_setaffinity(0, set(cores))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run")
    ap.add_argument("--generates", type=int, default=12, help="generate calls per mode and batch (default: 12)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--compiled", action="store_true", help="torch.compile'd forward over a static KV cache")
    ap.add_argument("--default-model", action="store_true", help="the shipped default model (vocabulary 8192)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--compile-mode", default=None, choices=(None, "reduce-overhead", "max-autotune-no-cudagraphs"),
                    help="torch.compile's mode with --compiled (reduce-overhead: CUDA graphs on a GPU)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--port", type=int, default=47811, help="TCP port of the naive baseline")
    ap.add_argument("--block", type=int, default=1,
                    help="steps per on or off stretch (default: 1, alternate every step). Longer stretches put "
                         "what a probed step leaves behind for the next one (caches, allocator state) inside "
                         "the probed stretch: if the figure holds with --block 4, little spills over")
    ap.add_argument("--settle", type=int, default=0,
                    help="leave out the first N steps after each switch, on and off alike (with --block > N). "
                         "Compiled, a switch makes the next step's lookup in Dynamo's cache try the other "
                         "graph's guards first: a cost of switching every step, which a session that stays "
                         "attached does not pay")
    ARGS = ap.parse_args()
    if ARGS.settle >= ARGS.block:
        ap.error("--settle must be smaller than --block")
    if ARGS.quick:
        ARGS.generates, ARGS.new_tokens = 2, 12
    main()
