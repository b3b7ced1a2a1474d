"""What a probe costs a compiled model: whole `generate` calls, interleaved, on prompts nothing was tuned on.

    python benchmarks/compiled_overhead.py                 # default model, model-core placement, 2 repeats
    python benchmarks/compiled_overhead.py --placement shared --quick

Modes, in rotating order per prompt (one process; the model's thread alone on core 0 with 1 torch thread in
the model-core placement, every thread on every core with 2 torch threads in the shared one):
  eager           plain `generate`, nothing compiled, no probe
  compiled        transformers' documented fast path: `model.forward = torch.compile(model.forward,
                  fullgraph=True)` and a static KV cache (one StaticCache of 512 positions per call), no probe
  compiled+probe  the same with `probe.attach(model, "layers.*.resid_post")` and a Subscriber in another
                  process reading everything, attached for the call and closed after it
  compiled+session  one such session attached for the whole run, resumed for the call and paused after it
                  (a long-observed model: its graphs are in Dynamo's cache, nothing is set up per call)
Every graph is compiled before the clock starts (a warm-up pass over every prompt in every mode).
Reported per set and decoding mode: each mode's median seconds per call, and the ratio of each call to the
`compiled` call of the same prompt and repeat (median and range), for the whole call and for its decode
steps alone (a streamer's timestamps from the first new token to the last). Greedy output is checked identical across
modes; sampled calls share a seed per prompt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StaticCache
from transformers.generation.streamers import BaseStreamer

import probe
from probebus.models import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _prompt_sets import load_sets  # noqa: E402
from overhead import DRAIN, machine, model_core, private_ipc  # noqa: E402

MODES = ("eager", "compiled", "compiled+probe", "compiled+session")


class DecodeClock(BaseStreamer):
    """Timestamps of every `put` (the prompt, then each new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass
SITES = "layers.*.resid_post"


def call(model, tok, compiled, prompt: str, mode: str, sample: bool, seed: int,
         endpoint: str, long: probe.ProbeSession) -> tuple[float, float, list[int]]:
    """(seconds of the call, seconds per decode step, the new tokens)."""
    ids = tok(prompt, return_tensors="pt").input_ids[:, -ARGS.prompt_tokens:]
    kw = dict(max_new_tokens=ARGS.new_tokens, min_new_tokens=ARGS.new_tokens, attention_mask=torch.ones_like(ids),
              pad_token_id=0, do_sample=sample)
    if sample:
        kw.update(temperature=0.8, top_k=0)
    if mode == "eager":
        model.__dict__.pop("forward", None)
    else:
        model.forward = compiled
        kw["cache"] = StaticCache(config=model.config, max_cache_len=ARGS.prompt_tokens + ARGS.new_tokens)
    session = probe.attach(model, SITES, endpoint=endpoint) if mode == "compiled+probe" else None
    if session is not None:
        session.wait_for_subscribers(1, timeout=30)
    if mode == "compiled+session":
        long.resume()
    clock = DecodeClock()
    torch.manual_seed(seed)
    with torch.no_grad(), model_core(ARGS.placement == "model-core"):
        t = time.perf_counter()
        out = model.generate(ids, streamer=clock, **kw)
        dt = time.perf_counter() - t
    if mode == "compiled+session":
        long.pause()
    if session is not None:
        session.close()
        session.join(30)  # the endpoint is free again once the subscriber has the end of stream
        stats = session.stats
        assert stats.dropped == 0 and stats.published == stats.captured > 0, stats
    step = (clock.times[-1] - clock.times[1]) / (len(clock.times) - 2)  # [0]: the prompt, [1]: after the prefill
    return dt, step, out[0, ids.shape[1]:].tolist()


def main() -> None:
    cores = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(1 if ARGS.placement == "model-core" else len(cores))
    if ARGS.placement == "model-core":
        if len(cores) < 2:
            sys.exit("the model-core placement needs 2 cores")
        os.sched_setaffinity(0, set(cores) - {0})  # what this process starts stays off core 0
    path = resolve_model("default")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    compiled = torch.compile(model.forward, fullgraph=True)
    endpoint = private_ipc()
    drain = subprocess.Popen([sys.executable, "-c", DRAIN, "probebus", endpoint])
    drain_long = subprocess.Popen([sys.executable, "-c", DRAIN, "probebus", endpoint + "-long"])
    long = probe.attach(model, SITES, endpoint=endpoint + "-long")
    long.wait_for_subscribers(1, timeout=30)
    long.pause()
    sets = {k: v[: ARGS.prompts] for k, v in load_sets(ARGS.sets).items()}
    print("machine:", machine())
    print(f"default model, fp32, {ARGS.placement} placement, last {ARGS.prompt_tokens} prompt tokens, "
          f"{ARGS.new_tokens} new tokens, {ARGS.prompts} prompts per set, {ARGS.repeats} repeats, sites {SITES}")
    try:
        t = time.perf_counter()
        for prompts in sets.values():  # compile every graph first: the prefill's shapes, both samplings
            for i, p in enumerate(prompts):
                for mode in MODES:
                    for sample in (False, True):
                        call(model, tok, compiled, p, mode, sample, i, endpoint, long)
        print(f"warm-up (compiles included) {time.perf_counter() - t:.0f} s")
        for name, prompts in sets.items():
            for sample in (False, True):
                secs: dict[str, list[float]] = {m: [] for m in MODES}
                ratios: dict[str, list[float]] = {m: [] for m in MODES}
                steps: dict[str, list[float]] = {m: [] for m in MODES}
                same = 0
                for r in range(ARGS.repeats):
                    for i, p in enumerate(prompts):
                        k = (i + r) % len(MODES)
                        got = {m: call(model, tok, compiled, p, m, sample, i, endpoint, long)
                               for m in MODES[k:] + MODES[:k]}
                        for m in MODES:
                            secs[m].append(got[m][0])
                            ratios[m].append(got[m][0] / got["compiled"][0])
                            steps[m].append(got[m][1] / got["compiled"][1])
                        same += len({tuple(v[2]) for v in got.values()}) == 1
                label = f"{name}, {'T = 0.8' if sample else 'greedy'}"
                print(f"\n{label}: {same}/{len(prompts) * ARGS.repeats} calls with the same tokens in every mode")
                for m in MODES:
                    rs, ds = ratios[m], steps[m]
                    print(f"  {m:17s} {1e3 * statistics.median(secs[m]):8.1f} ms/call   x compiled: call "
                          f"{statistics.median(rs):.3f} [{min(rs):.3f}-{max(rs):.3f}], decode step "
                          f"{statistics.median(ds):.3f} [{min(ds):.3f}-{max(ds):.3f}]")
        long.close()
        long.join(30)
        stats = long.stats
        assert stats.dropped == 0 and stats.published == stats.captured > 0, stats
    finally:
        drain.kill()
        drain_long.kill()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--placement", choices=("model-core", "shared"), default="model-core")
    ap.add_argument("--sets", nargs="+", default=["thirdparty", "prose"])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set (default: 8)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="a smoke run")
    ARGS = ap.parse_args()
    if ARGS.quick:
        ARGS.prompts, ARGS.repeats, ARGS.new_tokens, ARGS.sets = 2, 1, 16, ["prose"]
    main()
