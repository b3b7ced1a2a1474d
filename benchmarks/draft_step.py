"""What one draft token costs, per drafting method, against one decode step of the target (same run, interleaved).

    python benchmarks/draft_step.py                 # batch 1 and 8, 9 interleaved repeats of 50 steps each

Each method's own inference step on realistic shapes: EAGLE-3 (one drafter step), Medusa (all heads at
once, divided by the heads), MTP flat vs clustered (one step + its output head: the clustered head scores
C + V/C rows instead of V), DSpark (one pass for P positions, divided by P), a draft model and layer
skip (one token with a 64-token cache). Reports median and range of microseconds per draft token and
the ratio to the target's own decode step measured in the same repeats.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from transformers import DynamicCache

from decoder import load_named_drafter
from probebus._load import load_model


def lm_step(model: torch.nn.Module, batch: int):
    ids = torch.randint(3, model.config.vocab_size, (batch, 64))
    cache = DynamicCache()
    model(ids, cache=cache, use_cache=True)
    one = ids[:, -1:]
    return lambda: (model(one, cache=cache, use_cache=True), cache.crop(-1))


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model, _ = load_model("default")
    h = model.config.hidden_size
    eagle = load_named_drafter("eagle3", model)
    medusa, mtp = load_named_drafter("medusa", model).heads, load_named_drafter("mtp", model).heads
    clustered, dspark = load_named_drafter("clustered", model).heads, load_named_drafter("dspark", model).heads
    small, skip = load_named_drafter("draft-model", model), load_named_drafter("layer-skip", model)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"machine: {cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
          f"python {platform.python_version()}; layer skip keeps {skip.layers} of {model.config.num_hidden_layers} "
          f"layers; clustered: {clustered.config.clusters} clusters")
    for b in args.batches:
        x, tok = torch.randn(b, h), torch.randint(3, 8000, (b,))
        fns = {  # name -> (callable, draft tokens it yields)
            "target decode step": (lm_step(model, b), 1),
            "EAGLE-3 step": (_eagle(eagle, b), 1),
            "Medusa (all heads)": (lambda x=x: medusa(x), medusa.config.medusa_num_heads),
            "MTP flat": (lambda x=x, tok=tok: mtp.probs(mtp.step(x, tok)[1]), 1),
            "MTP clustered": (lambda x=x, tok=tok: clustered.probs(clustered.step(x, tok)[1]), 1),
            "DSpark (P positions)": (_dspark(dspark, x, tok), dspark.config.positions),
            "draft model": (lm_step(small.model, b), 1),
            "layer skip": (lm_step(skip.model, b), 1),
        }
        times: dict[str, list[float]] = {k: [] for k in fns}
        with torch.no_grad():
            for fn, _ in fns.values():
                fn()  # warm-up
            for rep in range(args.repeats):
                names = list(fns)
                for name in names[rep % len(names):] + names[: rep % len(names)]:
                    fn, per = fns[name]
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        fn()
                    times[name].append((time.perf_counter() - t0) / args.steps / per * 1e6)
        base = times["target decode step"]
        print(f"\nbatch {b}: microseconds per draft token, median [range]; ratio to a target decode step")
        for name, ts in times.items():
            ratio = statistics.median([t / p for t, p in zip(ts, base, strict=True)])
            print(f"  {name:22s} {statistics.median(ts):8.0f} [{min(ts):.0f}-{max(ts):.0f}]  {ratio:5.2f}")


def _eagle(drafter, b: int):
    step = drafter.fast()
    cache = drafter.new_cache(b, 96)
    hid = torch.zeros(b, 1, drafter.config.hidden_size)
    ids = torch.zeros(b, 1, dtype=torch.long)
    pos = torch.full((b, 1), 8)
    return lambda: step(hid, ids, pos, cache, 9)


def _dspark(head, x: torch.Tensor, tok: torch.Tensor):
    def run() -> None:
        base, prev = head.base(x, tok), tok
        for i in range(head.config.positions):
            prev = head.position(base[:, i], prev)[0].argmax(-1)
    return run


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    main(ap.parse_args())
