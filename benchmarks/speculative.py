"""Speculative decoding on prompts nothing was tuned on: plain `generate`, HF prompt lookup, HF assisted
generation, probebus n-gram, EAGLE-3, the round scheduler (auto), every other drafting method and the oracle
bound, per prompt set, batch size and temperature.

    python benchmarks/speculative.py                        # the scheduler's table: 3 sets x batch 1, 8 x T 0, 0.8
    python benchmarks/speculative.py --quick                # smoke run (~2 min)
    python benchmarks/speculative.py --sets prose --batches 1 --temperatures 0
    python benchmarks/speculative.py --methods all --batches 1 --no-oracle   # the per-method table (batch 1)
    python benchmarks/speculative.py --device cuda --sets stdlib --batches 1 8 --temperatures 0   # on a GPU

Three baselines in every row (issue 47): `plain` (transformers' eager `generate`), `HF compiled` (transformers'
documented fast path: a static KV cache and `torch.compile(model.forward, fullgraph=True)`, on a copy of the
target, its graphs compiled in the warm-up), and `loop, no drafter` (this loop's own plain steps); "x best" is
each method's speedup over the fastest of the three in the same repeat.

Methods (`--methods`, default: the three baselines, HF prompt lookup, n-gram, EAGLE-3, auto): `plain`,
`HF compiled`, `loop, no drafter`, `HF prompt lookup`,
`HF assisted` (transformers' assistant_model with the shipped draft model, batch 1), `n-gram`, `EAGLE-3`,
`EAGLE-3 tree`, `Medusa`, `Medusa tree`, `MTP`, `MTP attn` (DeepSeek-V3's block with attention), `clustered`,
`DSpark`, `draft model`, `layer skip`, `auto`, `auto, several` (the scheduler choosing per round among EAGLE-3,
MTP, clustered MTP, DSpark and n-gram), `loop compiled, no drafter` and `auto compiled` (compiled=True: every call's
forwards compiled), `auto, compiled=auto` (batch-1 calls compiled from the decoder's second call on, its own cost
curves), `loop eager, no drafter` and `auto, eager` (compiled=False: nothing compiled; every other row runs the
decoder's default, compiled="plain": a batch-1 call's plain steps on one compiled graph from a decoder's second
call on), `EAGLE-3 scheduled`, `Medusa scheduled`,
`MTP scheduled` (one model drafter under the round scheduler, as `probebus generate --drafter default|medusa|mtp`
runs it without --fixed);
`all` runs every one. "x loop" is a method's speedup over `loop, no drafter` in the same repeat (when it runs):
what drafting itself gains. Chains draft a fixed k; trees choose their node
count per round from the measured cost curve.

Sets (benchmarks/prompts/*.jsonl, see benchmarks/_prompt_sets.py): held-out stdlib files,
unseen third-party Python code, English prose. Each condition runs every method over the
whole set, call by call in a rotating order (each batch of prompts goes through every method
before the next batch), repeated, and reports the median and the range over repeats of
throughput and of the speedup against plain `generate` in the same repeat. Each probebus
decoder is built once per condition and learns across its calls, as it would serving them.
Plain `generate` and HF prompt lookup run with no probe attached: every decoder's probes
come off the model before a baseline call (checked). tau = tokens per row per verification
round (bonus included, plain rounds count 1); tok/fwd counts target forwards (prefill
included). "same" counts rows whose greedy output equals plain `generate`.

The oracle bound takes, per round in hindsight, the method (EAGLE-3, n-gram, none) and
draft length with the most tokens per second; it runs on the cost model's clock (the
target's forward time by length measured at load, and the drafter's step), so it is
printed next to the scheduler's run timed on that same clock.
"""

from __future__ import annotations

import argparse
import copy
import functools
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _prompt_sets import SETS, load_sets  # noqa: E402

from decoder import NgramDrafter, RemoteEagle, SpeculativeDecoder, load_drafter, load_named_drafter  # noqa: E402
from decoder.forward._compiled import CompiledForward  # noqa: E402
from decoder.loop import AUTO_K, FIXED_K, oracle_bound, simulated_seconds  # noqa: E402
from decoder.schedule import CostModel, PathChoice, Scheduler  # noqa: E402
from probebus._load import load_model  # noqa: E402

# Rows run the decoder's default (compiled="plain": a batch-1 call's plain steps on the compiled one-token graph from
# a decoder's second call on) unless their name says otherwise; the `eager` rows turn every compile off.
Eager = functools.partial(SpeculativeDecoder, compiled=False)


class ForwardCounter:
    def __init__(self, model: torch.nn.Module) -> None:
        self.n = 0
        self.h = model.register_forward_pre_hook(self._hook)

    def _hook(self, *args: object) -> None:
        self.n += 1

    def close(self) -> None:
        self.h.remove()


def no_hooks(model: torch.nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in model.modules())


NAMED = {"Medusa": "medusa", "Medusa tree": "medusa", "MTP": "mtp", "MTP attn": "mtp-attn", "clustered": "clustered",
         "DSpark": "dspark", "draft model": "draft-model", "layer skip": "layer-skip", "EAGLE-3 tree": "default"}
ALL = ["plain", "HF compiled", "loop, no drafter", "HF prompt lookup", "HF assisted", "n-gram", "EAGLE-3",
       "EAGLE-3 tree", "Medusa", "Medusa tree",
       "MTP", "MTP attn", "clustered", "DSpark", "draft model", "layer skip", "auto", "auto, several",
       "loop compiled, no drafter", "auto compiled", "auto, compiled=auto", "EAGLE-3 scheduled", "Medusa scheduled",
       "MTP scheduled", "loop eager, no drafter", "auto, eager"]
# A/B runs, named, never in 'all': the packed weights (LM head only, none), and n-gram trees (loop/_ngram_tree.py)
AB = ["plain, inference mode",  # `generate` under the decoder's inference mode: what the mode alone is worth
      "n-gram, packed=head", "auto, packed=head", "n-gram, packed=none", "auto, packed=none", "n-gram tree",
      "n-gram scheduled", "auto, chains",
      "auto, other drafter", "EAGLE-3, other drafter",  # the drafter of --other-drafter (an A/B of two heads)
      # the rules before 2026-12-07: greedy batch-1 calls chosen whole too (`PathChoice`), and a new call waiting
      # out the backoff an earlier call left (up to 64 rounds)
      "auto, whole calls", "EAGLE-3 scheduled, whole calls", "EAGLE-3 scheduled, call backoff 64",
      "auto, call backoff 64", "auto, verdict 0.5", "EAGLE-3 scheduled, verdict 0.5"]  # (before: VERDICT_KEEP 0.5)
DEFAULT = ["plain", "HF compiled", "loop, no drafter", "HF prompt lookup", "n-gram", "EAGLE-3", "auto"]
THREE = ("plain", "HF compiled", "loop, no drafter")  # the baselines "x best" divides by (those run)
OTHER: dict = {}  # "drafter": the head --other-drafter names, loaded once
# no probe, the target's own generate
BASELINES = ("plain", "HF compiled", "HF prompt lookup", "HF assisted", "plain, inference mode")
BATCH1 = ("HF prompt lookup", "HF assisted", "EAGLE-3 tree", "Medusa tree")  # batch 1 only


def make(name: str, model, drafter, cost: CostModel, k: int | None, remote_addr: str | None):
    """The method's decoder, with a whole-call path window of its own (`PathChoice`, keyed by drafter): rows that
    share a drafter (an A/B pair, EAGLE-3 fixed and scheduled) would otherwise choose each other's calls, as no two
    users' processes do. The cost curve stays shared (measured once)."""
    spec = _make(name, model, drafter, cost, k, remote_addr)
    if spec.cost is cost:
        spec.cost = copy.copy(cost)
        spec.cost.paths = PathChoice()
    return spec


def _make(name: str, model, drafter, cost: CostModel, k: int | None, remote_addr: str | None):
    if name.endswith((", whole calls", ", call backoff 64", ", verdict 0.5")):  # A/B of earlier rules
        spec = _make(name.split(",")[0], model, drafter, cost, k, remote_addr)
        if name.endswith("whole calls"):
            spec._chooses_calls = lambda batch, temperature: True
        elif name.endswith("verdict 0.5"):
            for sc in spec.drafters.scheds:
                sc.VERDICT_KEEP = 0.5
        else:  # a new call kept the wait and the verdict earlier calls left
            for sc in spec.drafters.scheds:
                sc.CALL_BACKOFF, sc.CALL_KEEP = Scheduler.MAX_BACKOFF, 1.0
        return spec
    if name.endswith(" scheduled") and name != "n-gram scheduled":  # one model drafter, the round scheduler
        base = name.removesuffix(" scheduled")  # (what `probebus generate --drafter NAME` runs without --fixed)
        d = drafter if base == "EAGLE-3" else load_named_drafter(NAMED[base], model)
        return SpeculativeDecoder(model, d, k=k, cost=cost)
    if name in NAMED:
        d = drafter if name == "EAGLE-3 tree" else load_named_drafter(NAMED[name], model)
        return SpeculativeDecoder(model, d, k=k, schedule="fixed", cost=cost, tree=24 if "tree" in name else 0)
    if ", packed=" in name:  # A/B of the packed weights (decoder/forward/_packed.py): the LM head only, or F.linear
        packed = name.split("=")[1]
        own = CostModel.for_target(model, refresh=True, packed=packed)
        d = NgramDrafter() if name.startswith("n-gram") else "auto"
        spec = SpeculativeDecoder(model, d, model_drafter=None if name.startswith("n-gram") else drafter, k=k,
                                  schedule="fixed" if name.startswith("n-gram") else "auto", cost=own,
                                  packed=packed)
        # Its own curve, measured now (a seeded call leaves the path choice alone): the shared curve of the
        # other methods is measured by whichever calls first, and a first call that measures looks slow.
        spec.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=8, seed=0)
        return spec
    if name.endswith(", other drafter"):  # the same decoder as the named row with --other-drafter's head
        return _make(name.split(",")[0], model, OTHER["drafter"], cost, k, remote_addr)
    if name in ("loop compiled, no drafter", "auto compiled"):  # the loop on a compiled target (forward/_compiled.py)
        if "compiled" not in OTHER:  # one curve for both, measured on the compiled forwards
            OTHER["compiled"] = CostModel.for_target(model, refresh=True, compiled=CompiledForward.of(model))
        auto = name == "auto compiled"
        return SpeculativeDecoder(model, "auto" if auto else None, model_drafter=drafter if auto else None, k=k,
                                  cost=OTHER["compiled"], compiled=True)
    if name == "auto, compiled=auto":  # batch-1 calls compiled from the decoder's second call on, its own curves
        return SpeculativeDecoder(model, "auto", model_drafter=drafter, k=k, refresh_cost=True, compiled="auto")
    if name == "loop, no drafter":  # what the loop's own steps are worth against `generate`, nothing drafted
        return SpeculativeDecoder(model, None, cost=cost)
    if name == "loop eager, no drafter":  # ...with nothing compiled (compiled=False)
        return Eager(model, None, cost=cost)
    if name == "auto, eager":  # the default decoder with nothing compiled (compiled=False)
        return Eager(model, "auto", model_drafter=drafter, k=k, cost=cost)
    if name == "n-gram":
        return SpeculativeDecoder(model, NgramDrafter(), k=k, schedule="fixed", cost=cost)
    if name in ("n-gram tree", "n-gram scheduled"):  # n-gram alone, scheduled, with and without its trees
        return SpeculativeDecoder(model, NgramDrafter(), k=k, cost=cost, ngram_tree=12 if name == "n-gram tree" else 0)
    if name == "auto, chains":
        return SpeculativeDecoder(model, "auto", model_drafter=drafter, k=k, cost=cost, ngram_tree=0)
    if name == "EAGLE-3":
        return SpeculativeDecoder(model, drafter, k=k, schedule="fixed", cost=cost)
    if name == "EAGLE-3 remote":
        return SpeculativeDecoder(model, RemoteEagle(remote_addr, timeout=120), k=k, schedule="fixed", cost=cost)
    if name == "auto":
        return SpeculativeDecoder(model, "auto", model_drafter=drafter, k=k, cost=cost)
    if name == "auto, several":  # the scheduler weighs EAGLE-3, MTP, clustered MTP, DSpark and n-gram per round
        several = [drafter] + [load_named_drafter(n, model) for n in ("mtp", "clustered", "dspark")]
        return SpeculativeDecoder(model, "auto", model_drafter=several, k=k, cost=cost)
    raise ValueError(name)


class Runner:
    """One method across a condition: its decoder, built once so that it learns across calls as it would
    serving them, and one timed call at a time (the condition interleaves methods call by call)."""

    def __init__(self, name: str, model, tok, temp: float, args, drafter, cost,
                 remote_addr: str | None = None) -> None:
        self.name, self.model, self.tok, self.temp, self.args = name, model, tok, temp, args
        self.spec = None if name in BASELINES else make(name, model, drafter, cost, args.k, remote_addr)
        self.new_repeat()

    def new_repeat(self) -> None:
        self.seconds, self.tokens, self.forwards = 0.0, 0, 0
        self.outs: list[list[int]] = []
        self.stats: list = []

    def quiet(self) -> None:
        """Take this decoder's probes off the model (a baseline is timed next); its next call puts them back."""
        if self.spec is not None and self.spec.session is not None:
            self.spec.target.capture(False)

    def call(self, prompts: list[str], new_tokens: int, others: list[Runner]) -> None:
        enc = self.tok(prompts, return_tensors="pt", padding=True).to(self.model.device)
        if self.spec is None:
            for other in others:
                other.quiet()
            if not no_hooks(self.model):
                raise RuntimeError("a probe is still attached while timing a baseline")
            kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=self.tok.pad_token_id,
                      eos_token_id=None, do_sample=self.temp > 0)
            if self.temp > 0:
                kw.update(temperature=self.temp, top_k=None, top_p=None)
            if self.name == "HF prompt lookup":
                kw["prompt_lookup_num_tokens"] = self.args.k or FIXED_K
            if self.name == "HF assisted":
                kw["assistant_model"] = assistant(self.model)
            model = self.model
            if self.name == "HF compiled":  # a fresh static cache a call, as transformers documents it
                model = compiled_copy(self.model)
                kw["cache"] = StaticCache(config=model.config, max_cache_len=static_len(enc, new_tokens))
                enc = enc.to(model.device)
            counter = ForwardCounter(model)
            t0 = time.perf_counter()
            with torch.inference_mode() if self.name == "plain, inference mode" else torch.no_grad():
                seq = model.generate(**enc, **kw)
            sync(self.model)
            self.seconds += time.perf_counter() - t0
            counter.close()
            self.forwards += counter.n
        else:
            t0 = time.perf_counter()
            out = self.spec.generate(enc.input_ids, enc.attention_mask, max_new_tokens=new_tokens,
                                     temperature=self.temp, pad_token_id=self.tok.pad_token_id)
            sync(self.model)
            self.seconds += time.perf_counter() - t0
            self.forwards += out.stats.target_forwards
            self.stats.append(out.stats)
            seq = out.sequences
        new = seq[:, enc.input_ids.shape[1]:]
        self.tokens += new.numel()
        self.outs.extend(new.tolist())

    def result(self) -> dict:
        row_rounds = sum(s.row_rounds for s in self.stats)
        tau = sum(s.tau * s.row_rounds for s in self.stats) / row_rounds if row_rounds else None
        return {"seconds": self.seconds, "tokens": self.tokens, "forwards": self.forwards, "tau": tau,
                "outs": self.outs, "stats": self.stats}

    def close(self) -> None:
        if self.spec is not None:
            self.spec.close()


def sync(model: torch.nn.Module) -> None:
    """On a GPU the clock stops when the device is done, not when the host has queued the work."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def assistant(model: torch.nn.Module) -> torch.nn.Module:
    """The shipped draft model as transformers' own assisted-generation baseline."""
    global _ASSISTANT
    if _ASSISTANT is None:
        _ASSISTANT = load_named_drafter("draft-model", model).model
    return _ASSISTANT


_ASSISTANT = None
_COMPILED = None


def static_len(enc: object, new_tokens: int) -> int:
    """The static cache's positions for a call: its prompt and new tokens, rounded up to 64 (as tight as
    transformers sizes it, so a decode step attends over what it needs; a few lengths, each compiled in the
    warm-up)."""
    return -(-(enc.input_ids.shape[1] + new_tokens) // 64) * 64


def compiled_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the target with its forward compiled (transformers' fast path), so that the decoders' own
    forwards on the target stay eager and no compiled graph sees their probes."""
    global _COMPILED
    if _COMPILED is None:
        import copy

        _COMPILED = copy.deepcopy(model)
        _COMPILED.forward = torch.compile(_COMPILED.forward, fullgraph=True)
    return _COMPILED


def oracle(model, tok, prompts: list[str], batch: int, temp: float, args, drafter, cost) -> dict:
    spec = SpeculativeDecoder(model, "auto", model_drafter=drafter, k=args.k, cost=cost)
    o_sec = p_sec = auto_sec = 0.0
    tau_num = tau_den = 0.0
    try:
        for i in range(0, len(prompts), batch):
            enc = tok(prompts[i: i + batch], return_tensors="pt", padding=True).to(model.device)
            res = oracle_bound(spec, enc.input_ids, enc.attention_mask, max_new_tokens=args.new_tokens,
                               temperature=temp, seed=i)
            prefill = res.plain_seconds - (args.new_tokens - 1) * cost.verify(enc.input_ids.shape[0], 1, frozen=True)
            out = spec.generate(enc.input_ids, enc.attention_mask, max_new_tokens=args.new_tokens, temperature=temp,
                                pad_token_id=tok.pad_token_id)
            o_sec += res.seconds
            p_sec += res.plain_seconds
            # a call handed to `generate` ran plain steps: on the cost model's clock, what plain costs
            auto_sec += res.plain_seconds if out.stats.delegated else simulated_seconds(out.stats, cost, prefill)
            tau_num += res.tau * res.row_rounds
            tau_den += res.row_rounds
    finally:
        spec.close()
    return {"speedup": p_sec / o_sec, "auto_speedup": p_sec / auto_sec, "tau": tau_num / max(tau_den, 1)}


def condition(model, tok, name: str, prompts: list[str], batch: int, temp: float, args, drafter, cost,
              remote_addr: str | None) -> None:
    methods = [m for m in args.methods if batch == 1 or m not in BATCH1]
    if remote_addr:
        methods.insert(-1, "EAGLE-3 remote")
    b = min(batch, len(prompts))
    cost.ensure(b, args.k or AUTO_K, drafter)
    runners = {m: Runner(m, model, tok, temp, args, drafter, cost, remote_addr) for m in methods}
    every = list(runners.values())
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    try:
        learned = cost.paths  # warm-up (first-call costs, the cost curve's measurement): not timed, and auto's
        cost.paths = PathChoice()  # hand-over learns nothing from its short calls
        for m in methods:
            runners[m].call(prompts[:b], min(args.new_tokens, 8), every)
        for r in every:  # a second call compiles (batch 1; "plain": where its plain steps may run): paid once
            if r.spec is not None and r.spec.compiled in ("auto", "plain"):
                r.call(prompts[:b], min(args.new_tokens, 8), every)
        cost.paths = learned
        # Call by call, in a rotating order: blocks of whole sets drifted apart on this VM (plain ran 114-136
        # tok/s between blocks of one evening), which no ratio of block totals can take out.
        chunks = [prompts[i: i + batch] for i in range(0, len(prompts), batch)]
        if "HF compiled" in runners:  # every graph compiled before the clock starts (each prompt's shapes)
            for chunk in chunks:
                runners["HF compiled"].call(chunk, args.new_tokens, every)
        for rep in range(args.repeats):
            for r in every:
                r.new_repeat()
            for j, chunk in enumerate(chunks):
                s = (rep + j) % len(methods)
                for m in methods[s:] + methods[:s]:
                    runners[m].call(chunk, args.new_tokens, every)
            for m in methods:
                runs[m].append(runners[m].result())
    finally:
        for r in every:
            r.close()
    ref = runs["plain"][0]["outs"]
    print(f"\n{name}, batch {batch}, T={temp:g}: {len(prompts)} prompts x {args.new_tokens} tokens, "
          f"{args.repeats} interleaved repeats, median [range]")
    three = [m for m in THREE if m in runs]
    loop = "loop, no drafter" if "loop, no drafter" in runs else None
    print(f"  {'method':17s} {'tok/s':>7s} {'[range]':>15s} {'speedup':>8s} {'[range]':>13s} {'x best':>7s} "
          f"{'x loop':>7s} {'tau':>5s} {'tok/fwd':>7s} {'same':>6s} {'draft/verify ms per round':>26s}")
    for m in methods:
        rs = runs[m]
        tps = [r["tokens"] / r["seconds"] for r in rs]
        sp = [p["seconds"] / r["seconds"] for p, r in zip(runs["plain"], rs, strict=True)]
        best = [min(runs[b][i]["seconds"] for b in three) / r["seconds"] for i, r in enumerate(rs)]
        # x loop: against the loop's own plain decoding, nothing drafted (what drafting itself gains), same repeat
        xl = f"{statistics.median(runs[loop][i]['seconds'] / r['seconds'] for i, r in enumerate(rs)):6.2f}x" \
            if loop else "-"
        tau = f"{rs[0]['tau']:.2f}" if rs[0]["tau"] is not None else "-"
        same = sum(a == b for a, b in zip(rs[0]["outs"], ref, strict=True)) if temp == 0 else None
        print(f"  {m:17s} {statistics.median(tps):7.1f} {f'[{min(tps):.1f}-{max(tps):.1f}]':>15s} "
              f"{statistics.median(sp):7.2f}x {f'[{min(sp):.2f}-{max(sp):.2f}]':>13s} "
              f"{statistics.median(best):6.2f}x {xl:>7s} {tau:>5s} "
              f"{rs[0]['tokens'] / max(rs[0]['forwards'] * batch, 1):7.2f} "
              f"{'-' if same is None else f'{same}/{len(ref)}':>6s} {per_round(rs[0]['stats']):>26s}")
    if not args.no_oracle:
        o = oracle(model, tok, prompts, batch, temp, args, drafter, cost)
        print(f"  {'oracle bound':17s} {'':>7s} {'':>15s} {o['speedup']:7.2f}x {'(cost model)':>13s} {o['tau']:5.2f}"
              f"   -- auto on the same clock: {o['auto_speedup']:.2f}x")
    if batch != 1:
        print("  (HF prompt lookup and assisted generation support batch size 1 only; trees run at batch 1)")


def per_round(stats: list) -> str:
    """Mean milliseconds per round spent drafting and verifying (the loop's own clocks; the prefill and a handed-over
    rest are not rounds), or '-' for baselines."""
    rounds = sum(s.rounds for s in stats)
    if not rounds:
        return "-"
    return f"{sum(s.draft_s for s in stats) / rounds * 1e3:.2f} / {sum(s.verify_s for s in stats) / rounds * 1e3:.2f}"


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, device=args.device)
    drafter = load_drafter(args.drafter, model)
    if args.other_drafter:
        OTHER["drafter"] = load_drafter(args.other_drafter, model)
    sets = load_sets(args.sets)
    cost = CostModel.for_target(model, refresh=not args.cached_cost)  # this machine, now (the cache may be stale)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor() or "?")
    if model.device.type == "cuda":
        cpu += f" + {torch.cuda.get_device_name(model.device)}"
    print(f"machine: {cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
          f"python {platform.python_version()}")
    print(f"target: {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {model.dtype}), "
          f"drafter {drafter.source} (confidence head: {'yes' if drafter.confidence is not None else 'no'}), "
          f"k={args.k or f'{FIXED_K} fixed and HF, {AUTO_K} scheduled'}, {args.new_tokens} new tokens")
    remote_addr, server = None, None
    if args.remote:
        import subprocess

        remote_addr = "tcp://127.0.0.1:47920"
        server = subprocess.Popen([sys.executable, "-m", "probebus", "serve-drafter", "--bind", remote_addr,
                                   "--model", args.model, "--drafter", args.drafter])
    try:
        for name in args.sets:
            prompts = sets[name][: args.prompts]
            for temp in args.temperatures:
                for batch in args.batches:
                    condition(model, tok, name, prompts, batch, temp, args, drafter, cost, remote_addr)
        for b in sorted({min(x, args.prompts) for x in args.batches}):
            # trees verify up to 25
            longest = 24 if b == 1 and any("tree" in m for m in args.methods) else args.k or AUTO_K
            c = cost.curve(b, min(longest, len(cost.data[str(b)]["verify"]) - 1), frozen=True)
            print(f"cost curve at batch {b} (forward of L tokens / 1 token): "
                  f"{[round(x / c[0], 2) for x in c]}, 1 token = {c[0] * 1e3:.2f} ms, drafter step "
                  f"{cost.step(b, frozen=True) * 1e3:.2f} ms")
    finally:
        if server is not None:
            RemoteEagle(remote_addr, timeout=30).shutdown()
            server.wait(30)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 prompts, 24 tokens, 1 repeat, batch 1 and 4")
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS, help="prompt sets (default: all)")
    ap.add_argument("--prompts", type=int, default=24, help="prompts per set (default: %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=96, help="(default: %(default)s)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="(default: %(default)s)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8], help="(default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default: %(default)s)")
    ap.add_argument("--k", type=int, default=None, help="draft length of the fixed rows and HF prompt lookup, longest "
                    "draft of the scheduled ones (default: 5 fixed and HF, 8 scheduled: the decoder's own defaults)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--other-drafter", default=None, metavar="DIR", help="a second EAGLE-3 head for the rows "
                    "'auto, other drafter' and 'EAGLE-3, other drafter' (e.g. the one shipped before a retrain)")
    ap.add_argument("--methods", nargs="+", default=DEFAULT, help="methods to run, or 'all' (default: %(default)s)")
    ap.add_argument("--remote", action="store_true", help="add EAGLE-3 with the drafter in another process")
    ap.add_argument("--no-oracle", action="store_true", help="skip the oracle bound (it costs 3 forwards a round)")
    ap.add_argument("--cached-cost", action="store_true", help="reuse the cached cost curve instead of measuring it "
                    "again at the start (a curve measured on a busy machine misleads the scheduler)")
    a = ap.parse_args()
    a.methods = ALL if a.methods == ["all"] else a.methods
    unknown = [m for m in a.methods if m not in ALL + AB]
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {ALL + AB} or 'all'")
    if any(m.endswith(", other drafter") for m in a.methods) and not a.other_drafter:
        ap.error("the 'other drafter' rows need --other-drafter DIR")
    if a.quick:
        a.prompts, a.new_tokens, a.repeats, a.batches = 4, 24, 1, [1, 4]
    sys.exit(main(a))
