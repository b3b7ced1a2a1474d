"""What the taps add to a compiled forward alone: the graph's extra outputs, Dynamo's guards and its replay.

    python benchmarks/compiled_forward.py              # the default model, ~1 min
    python benchmarks/compiled_forward.py --rounds 20  # a smoke run

`paired_steps.py` measures a whole decode step inside `generate` (the step hooks, the copies, and a forward
that runs after them on caches they and `generate` have used), where a run's spread is ~±50 us. This calls
the compiled `model.forward` of one decode step of a static-cache `generate` again and again (the cache's
length put back before each call), in blocks that switch the session's taps on and off (the first call of a
block left out: it pays the switch), with the step hooks out of the way: the difference is what the tapped
graph itself costs. The plain calls run the graph compiled before attach, with the session's taps taken off:
nothing of probebus runs in them, though the session (its idle threads) stays attached; no probe is attached
while that graph compiles. The model's thread alone on core 0, 1 torch thread (the whole process is pinned there:
this measures the graph, not how the bus shares cores; `paired_steps.py` and `overhead.py --placement shared` do).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, StaticCache

import probe
from probe import _hooks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import bootstrap_median  # noqa: E402
from overhead import machine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=180, help="blocks per mode (default: 180)")
    ap.add_argument("--block", type=int, default=4, help="calls per block, the first left out (default: 4)")
    args = ap.parse_args()
    from probebus.models import resolve_model

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {0})
    model = AutoModelForCausalLM.from_pretrained(resolve_model("default"), dtype=torch.float32).eval()
    model.forward = torch.compile(model.forward, fullgraph=True)
    ids = torch.randint(3, 8192, (1, 64), generator=torch.Generator().manual_seed(1))
    step: dict = {}

    def keep(module: torch.nn.Module, a: tuple, kwargs: dict) -> None:
        if kwargs["input_ids"].shape[1] == 1:
            step.setdefault("kwargs", dict(kwargs))

    def generate() -> None:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids),
                           cache=StaticCache(config=model.config, max_cache_len=96), pad_token_id=0)

    handle = model.register_forward_pre_hook(keep, with_kwargs=True)
    generate()  # compiles the plain graphs
    handle.remove()
    kwargs, lengths = step["kwargs"], [layer.cumulative_length.clone() for layer in step["kwargs"]["cache"].layers]
    session = probe.attach(model, "layers.*.resid_post")
    sites, hooks = list(session.sites), session._hooks
    generate()  # compiles the tapped graphs
    times: dict[bool, list[float]] = {True: [], False: []}
    with torch.no_grad():
        for r in range(2 * args.rounds):
            on = r % 4 in (0, 3)  # on, off, off, on: neither mode always follows the other
            hooks.change("add" if on else "remove", sites)
            for i in range(args.block):
                for layer, n in zip(kwargs["cache"].layers, lengths, strict=True):
                    layer.cumulative_length.copy_(n)
                t = time.perf_counter()
                model.forward(**kwargs)  # the compiled forward alone: no step hooks
                dt = time.perf_counter() - t
                hooks._gather()  # what the taps staged leaves, as at a step's end
                hooks._staged.clear()
                if i:
                    times[on].append(dt)
    session.close()
    assert not getattr(_hooks, "_traced", [])  # (an older checkout has no such list)
    plain, tapped = statistics.median(times[False]), statistics.median(times[True])
    pairs = [a - b for a, b in zip(times[True], times[False], strict=False)]
    lo, hi = bootstrap_median(pairs)
    print("machine:", machine())
    print(f"the default model's compiled decode step (static cache, batch 1), model.forward alone, "
          f"{len(times[True])} calls a mode in blocks of {args.block - 1}")
    print(f"  plain graph   median {1e6 * plain:8.1f} us")
    print(f"  tapped graph  median {1e6 * tapped:8.1f} us")
    print(f"  tapped - plain: {1e6 * (tapped - plain):+.1f} us (median of matched calls "
          f"{1e6 * statistics.median(pairs):+.1f} us, 90 % interval {1e6 * lo:+.1f}..{1e6 * hi:+.1f})")


if __name__ == "__main__":
    main()
