"""Speculative decoding as a subscriber of the probe bus.

    with SpeculativeDecoder(target, "auto") as spec:          # EAGLE-3 (if one ships) + n-gram, scheduled, k <= 8
        out = spec.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    out.sequences, out.stats.tau

A call picks its path (every drafter, n-gram alone, or plain decoding: `PathChoice`, from measured calls),
prefills, then runs rounds until every row is done. `_round` is the one place a chain round runs, stage by
stage, each stage given what it needs:

    plan     `plan_round`     n-gram proposals, the scheduler's plan, which model drafter to ask (`_chain_round.py`)
    draft    `draft_round`    the model drafter drafts under its stopping rule; per row: its drafts, n-gram or none
    verify   `forward_round`  the target over [last, d1..dn], probes on the drafters' feature sites (phase
             `verify_round`   `verify`), then the acceptance rule (`decoder.verify`)
    commit   `Run.keep`       tokens, masked holes, cache crop, the drafters' feeds, n-gram index, streamer
    account  `account`        statistics, calibrations, the cost model's online refinement (`_accounting.py`)

A model drafter reads the accepted positions' features off the bus when it next drafts. Batch 1 may verify
trees instead (`tree=N`: `_tree_round.py`; n-gram trees: `_ngram_tree.py`); a call that measures itself losing
hands its rest to plain decoding (`_plain.py`). `schedule="fixed"` drafts exactly k every round with the given
drafter (the classic loop, kept for comparison).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import verify
from ..drafters import Eagle3Drafter, Feeder, MedusaFeeder, NgramDrafter
from ..forward._compiled import StaticLoopCache
from ..schedule import NGRAM_PATHS, PATHS, CostModel
from ._accounting import account
from ._chain_round import RoundDrafts, draft_round, forward_round, plan_round, verify_round
from ._drafters import ModelDrafters
from ._ngram_tree import ngram_tree_round, widen
from ._plain import hand_over, loop_plain, losing, plain_call, plain_round
from ._run import Run, check_call, eos_list
from ._stats import SpecOutput
from ._target import Target
from ._tree_round import supports_tree, tree_round

log = logging.getLogger("decoder")

# The longest draft: scheduled, a longer ceiling only adds options the cost curve may take; a fixed schedule drafts
# exactly k every round, where 5 stays the better length (measured: docs/design.md, "Decoder: measurements behind
# the code").
AUTO_K, FIXED_K = 8, 5

ModelDrafter = Eagle3Drafter | Feeder


def inference(fn: Callable[..., SpecOutput]) -> Callable[..., SpecOutput]:
    """Run a decoding call under `torch.inference_mode`, its output sequences copied out of it after.

    Why: inference mode skips the version counters and view tracking that `no_grad` keeps for every op, and a
    small model's forward is mostly per-op overhead (measured: docs/design.md, "Decoder: measurements behind the
    code"). What the call creates (caches, the drafter's buffers) is an inference tensor, written only by later
    calls (inside the mode again). The sequences handed back are cloned outside it: an inference tensor cannot be
    saved for a backward pass, and a caller may well feed the output to a forward with gradients (a loss, a
    fine-tune)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> SpecOutput:
        with torch.inference_mode():
            out = fn(*args, **kwargs)
        return SpecOutput(out.sequences.clone(), out.stats)
    return call


class SpeculativeDecoder:
    """drafter: an Eagle3Drafter, any other Feeder (`RemoteEagle`, Medusa/MTP/DSpark heads, a draft model, layer
    skip), a list of them (the scheduler picks one per round), an NgramDrafter, "auto" (EAGLE-3 if one ships
    with the target, or `model_drafter=` one drafter or a list, plus n-gram), or None (plain steps). k is the
    longest draft (default: AUTO_K scheduled, FIXED_K with schedule="fixed"); tree=N verifies draft trees of up to
    N nodes at batch 1 (EAGLE-3, Medusa)."""

    def __init__(self, target: nn.Module,
                 drafter: ModelDrafter | list[ModelDrafter] | NgramDrafter | str | None = None, *,
                 k: int | None = None, ngram: NgramDrafter | None = None,
                 model_drafter: ModelDrafter | list[ModelDrafter] | None = None, endpoint: str | None = None,
                 schedule: str = "auto", cost: CostModel | None = None, tree: int = 0, tree_top_k: int = 4,
                 packed: str = "all", ngram_tree: int = 12, compiled: bool | str = "plain",
                 refresh_cost: bool = False) -> None:
        if schedule not in ("auto", "fixed"):
            raise ValueError(f"schedule must be 'auto' or 'fixed', got {schedule!r}")
        if compiled not in (True, False, "auto", "plain"):
            raise ValueError(f"compiled must be True, False, 'auto' or 'plain', got {compiled!r}")
        if k is None:
            k = FIXED_K if schedule == "fixed" else AUTO_K
        if k < 1:
            raise ValueError(f"k (the longest draft) must be >= 1, got {k}")
        self.k = k
        self.target = Target(target, packed, session=None, compiled=compiled is not False)
        self.compiled = compiled
        self.calls = 0  # calls made: "auto" and "plain" compile from the second batch-1 call on (`compiles`)
        self.static = False  # whether the current (or last) call runs compiled
        if drafter == "auto":
            if model_drafter is None:
                from ..drafters import DrafterError, load_drafter

                with contextlib.suppress(DrafterError):
                    model_drafter = load_drafter("default", target)
            self.model_drafter, self.ngram = model_drafter, ngram or NgramDrafter()
        elif isinstance(drafter, str):
            raise ValueError(f"drafter must be a drafter object, 'auto' or None, got {drafter!r}")
        else:
            self.ngram = drafter if isinstance(drafter, NgramDrafter) else None
            self.model_drafter = None if drafter is None or isinstance(drafter, NgramDrafter) else drafter
        if schedule == "fixed" and self.model_drafter is not None and self.ngram is not None:
            raise ValueError("schedule='fixed' drafts with one method; 'auto' chooses between a model drafter and "
                             "n-gram")
        given = self.model_drafter
        listed = list(given) if isinstance(given, list | tuple) else ([] if given is None else [given])
        if len(listed) > 1 and schedule == "fixed":
            raise ValueError("schedule='fixed' drafts with one method; 'auto' chooses among several drafters")
        self.drafters = ModelDrafters(target, listed, endpoint, k, fixed=schedule == "fixed")
        self.target.session = self.drafters.session
        # the session's taps come off until a call wants them: between calls the model is anyone's (a plain
        # `generate`, another decoder, a compiled graph traced now), and its forwards are not this decoder's to publish
        self.target.capture(False)
        self.sched = self.drafters.scheds[0]  # the first model drafter's scheduler state (or n-gram's alone)
        # the cost curves: the one given (every call), else one of the eager forwards and one of the compiled
        # ones, each made when a call first runs that way (`cost_for`)
        self._given_cost, self._costs = cost, {}
        self._refresh_cost = refresh_cost
        self.cost = self.cost_for(self.compiles(1))  # (a first call's: before it, no call has run)
        if ngram_tree < 0:
            raise ValueError(f"ngram_tree (most nodes of an n-gram tree) must be >= 0, got {ngram_tree}")
        self.ngram_tree = ngram_tree if self.ngram is not None and schedule == "auto" else 0
        if tree < 0 or tree_top_k < 1:
            raise ValueError(f"tree (most nodes) must be >= 0 and tree_top_k >= 1, got {tree}, {tree_top_k}")
        if tree and (len(self.drafters) != 1 or not supports_tree(self.drafters.slots[0].feeder)):
            raise ValueError("tree drafts need EAGLE-3 or Medusa heads, or the MTP block with attention (one drafter "
                             "that scores alternatives); use tree=0 for this drafter")
        if tree and not isinstance(self.model_drafter, (Eagle3Drafter, MedusaFeeder)):
            raise ValueError("tree drafts need the drafter in this process (Eagle3Drafter or MedusaFeeder)")
        self.tree, self.tree_top_k = tree, tree_top_k
        self.has_drafter = len(self.drafters) > 0 or self.ngram is not None  # False: every round is a plain step

    def compiles(self, batch: int) -> bool:
        """Whether a call of `batch` rows runs its forwards compiled over a static cache (`forward/_compiled.py`):
        compiled=True always, False and "plain" (the default: see `compiles_plain`) never, "auto" batch-1 calls from
        the decoder's second call on.
        Why "auto" skips batch 8: attending over the static cache's whole capacity, the compiled loop ran 0.81x the
        eager one there. Why it skips a first call: that call compiles every graph it may run (30-37 s for auto on
        the default model with Inductor's disk cache warm, 162 s cold, against 0.1 s eager), so a one-off call stays
        quick and a decoder that is reused pays it once. Why none of it is the default: on this project's CPU the
        compiled loop did not beat the eager one (docs/design.md, "The speculative loop on a compiled target")."""
        return self.compiled != "plain" and self.compiles_plain(batch)  # (the same rule, every forward)

    def compiles_plain(self, batch: int) -> bool:
        """Whether a call of `batch` rows runs its plain steps (a whole call on the plain path, a decoder with
        nothing to draft, the rest of a sampled call that measured itself losing) on the compiled one-token graph
        over a static cache: compiled=True always, "auto" and "plain" (the default) at batch 1 from the decoder's
        second call on, "plain" on the CPU only (measured there alone), False never. Why by default: where nothing
        is drafted (sampling, here), the eager loop's plain steps ran 0.93-0.97x transformers' compiled `generate`
        and the compiled ones 0.99-1.12x, for one graph (7.7 s to compile with Inductor's disk cache warm, 36 s
        cold, paid by a decoder's second call). Why not batch 8: there the eager loop's plain steps were the faster
        (docs/design.md, "The speculative loop on a compiled target")."""
        if self.target.compiled is None or self.compiled is False:
            return False
        if self.compiled == "plain" and not loop_plain(self.target.device):
            return False
        return self.compiled is True or (batch == 1 and self.calls > 0)

    def cost_for(self, compiled: bool) -> CostModel:
        """The cost curve of the loop's eager or compiled forwards (the one given to the constructor for both)."""
        if self._given_cost is not None:
            return self._given_cost
        own = self._costs.get(compiled)
        if own is None:
            packed_kind = self.target.packed.kind if self.target.packed is not None else "none"
            own = self._costs[compiled] = CostModel.for_target(
                self.target.model, packed=packed_kind, refresh=self._refresh_cost,
                compiled=self.target.compiled if compiled else None)
        return own

    def path_key(self, batch: int, temperature: float) -> tuple:
        """Whose calls `cost.paths` compares: this batch, greedy or sampling, and this decoder's drafters."""
        drafters = "+".join(type(s.feeder).__name__ for s in self.drafters.slots)
        return (batch, "sample" if temperature > 0 else "greedy", f"{drafters}|ngram={self.ngram is not None}|"
                f"k={self.k}|tree={self.tree}|ngram_tree={self.ngram_tree}")

    @property
    def session(self) -> Any:
        """The probe session on the model drafters' feature sites (a `probe.Session`), or None."""
        return self.target.session

    @property
    def endpoint(self) -> str | None:
        """The probe session's endpoint (watch it with `probebus top`), or None without a feature-fed drafter."""
        return self.session.endpoint if self.session is not None else None

    def close(self) -> None:
        self.drafters.close()  # first: the session then has no one to wait for at its end of stream
        self.target.close()

    def __enter__(self) -> SpeculativeDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- a call ---------------------------------------------------------------------
    @inference
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 32, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, seed: int | None = None, streamer: object = None) -> SpecOutput:
        """Greedy output equals `target.generate(do_sample=False)`; sampling follows the target's distribution
        exactly. `streamer` takes transformers' streamer interface (put(ids), end()); batch 1 only."""
        t0 = time.perf_counter()
        self.static = self.compiles(input_ids.shape[0])  # this call's forwards: compiled, or eager
        plain_graph = self.compiles_plain(input_ids.shape[0])  # ...and its plain steps
        if self._given_cost is None:  # (a given curve serves every call, as given or as set on `cost` since)
            self.cost = self.cost_for(self.static)
        self.calls += 1
        key = self.path_key(input_ids.shape[0], temperature)
        auto = not self.sched.fixed and seed is None and self.has_drafter
        whole = auto and self._chooses_calls(input_ids.shape[0], temperature)
        path = self.cost.paths.pick(key, self._paths(input_ids.shape[0], temperature)) if whole else "spec"
        plain = path == "plain"
        if plain and not loop_plain(self.target.device):
            out = plain_call(self.target, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p,
                             eos_token_id, pad_token_id, streamer)
            self.cost.paths.observe(key, "plain", out.stats.tokens_per_s, out.stats.emitted)
            return out
        # a plain call on CPU: the loop's own plain rounds (`loop_plain`), compiled where `compiles_plain`
        self.static = self.static or (plain_graph and (plain or not self.has_drafter))
        run = self.new_run(input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed,
                           streamer, drafting=not plain, model_drafters=path == "spec", static=self.static)
        run.plain_graph = plain_graph
        if plain_graph and not self.static and auto and run.mode == "sample":
            t_warm = time.perf_counter()  # the graph a hand-over's plain steps run, compiled before the call starts
            self.target.warm_plain(run)
            run.setup_s += time.perf_counter() - t_warm
        if self.target.packed is not None:
            t_pack = time.perf_counter()
            self.target.packed.refresh()  # weights changed since the last call are packed again
            if self.target.compiled is not None and self.target.compiled.packed is not self.target.packed:
                self.target.compiled.refresh()  # (the compiled forwards' packed copies too, where apart)
            run.setup_s += time.perf_counter() - t_pack  # (the first call's packing is not what drafting costs)
        try:
            self.prefill(run)
            spec_part = self._rounds(run, auto, t0)
        finally:
            self.target.capture(False)  # probes publish during this decoder's calls only (`Target.capture`)
        run.stats.seconds = time.perf_counter() - t0
        run.stats.path = path
        if run.streamer is not None:
            run.streamer.end()
        if plain:  # (its rate without the setup: a first compiled call's compile is not what plain steps cost)
            run.stats.delegated = True
            seconds = run.stats.seconds - run.setup_s
            self.cost.paths.observe(key, "plain", run.stats.emitted / max(seconds, 1e-9), run.stats.emitted)
        elif auto:  # what drafting achieved: a handed-over call counts its speculative part
            tokens, seconds = spec_part or (run.stats.emitted, run.stats.seconds)
            seconds -= run.setup_s
            self.cost.paths.observe(key, path, tokens / max(seconds, 1e-9), tokens)
        return SpecOutput(run.sequences(pad_token_id), run.stats)

    def _chooses_calls(self, batch: int, temperature: float) -> bool:
        """Whether whole calls choose their path (`PathChoice`) before the rounds choose theirs. Not a greedy call
        at batch 1 whose plain path is the loop's own plain rounds (`loop_plain`): there the rounds already take
        plain steps where drafting does not pay, so the calls a whole-call choice spends on plain decoding or on
        re-measuring (acceptance differs widely between prompts) were mostly lost: `auto` on CPU, both rules in
        one run, 1.49x / 1.57x / 1.48x the plain loop on stdlib / third-party code / prose against 1.50x / 1.51x /
        1.41x (docs/benchmarks.md, "The scheduler's give-up"). Sampled calls (whose drafts are rarely accepted
        here), batches, and `generate` as the plain path keep the choice."""
        return not (temperature == 0 and batch == 1 and loop_plain(self.target.device))

    def _paths(self, batch: int, temperature: float) -> tuple[str, ...]:
        """The paths a call may take (`PathChoice`). A sampled call at batch 1 with a model drafter and n-gram
        lookup may also run n-gram alone, probes off: at T = 0.8 the model drafter's drafts are rarely accepted,
        and its steps and the probes' capture cost more than per-round consults win back. Not at batch 8, where
        n-gram alone measured slower than plain steps, so measuring that path only costs calls (docs/design.md,
        "Decoder: measurements behind the code")."""
        if temperature > 0 and batch == 1 and len(self.drafters) > 0 and self.ngram is not None:
            return NGRAM_PATHS
        return PATHS

    def new_run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int,
                temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                eos: int | list[int] | None = None, seed: int | None = None, streamer: object = None,
                drafting: bool = True, model_drafters: bool = True, static: bool = False) -> Run:
        """A call's state, its drafters prepared; with `drafting` False (plain rounds only) no cost curve, drafter
        buffers or n-gram index are set up, and with `model_drafters` False (n-gram alone) no drafter buffers.
        `static`: the call's forwards run compiled over a static cache (`compiles`; default eager)."""
        check_call(input_ids, max_new_tokens, streamer)
        param = next(self.target.model.parameters())
        # A seed reproduces the output: the schedule then depends on nothing timed or learned in earlier calls
        # (priors and the cost curve as loaded); unseeded calls adapt to measured time and keep what they learn.
        scheds = self.drafters.scheds if seed is None else self.drafters.fresh_scheds()
        run = Run(input_ids, attention_mask, max_new_tokens=max_new_tokens, k=self.k, eos=eos_list(eos),
                  device=param.device, scheds=scheds, dtype=param.dtype, temperature=temperature, top_k=top_k,
                  top_p=top_p, seed=seed, streamer=streamer, drafting=drafting, model_drafters=model_drafters)
        if static:  # a static cache, unless a drafter reads the cache as it grows
            binds = run.model_drafters and any(hasattr(sl.feeder, "bind_run") for sl in self.drafters.slots)
            # the mask's columns (prompt, new tokens, a round's drafts) and a tree's nodes; more grows it
            run.cache = self.target.new_cache(run.b, run.mask.shape[1] + max(self.tree, self.ngram_tree) + 1,
                                              static=not binds)
            if not binds:  # the graphs this call may run, compiled before it starts (not what drafting costs)
                t_warm = time.perf_counter()
                longest = [self.k + 1, self.ngram_tree + 1, self.tree + 1] if drafting and self.has_drafter else []
                lengths = [1, *range(2, max(longest, default=1) + 1)]
                # with a model drafter the probes stay on through most rounds (n-gram's and trees' too): every
                # length gets its graph with the taps in as well
                self.target.warm(run, lengths, tapped=run.model_drafters)
                run.setup_s += time.perf_counter() - t_warm
        for sc in run.scheds:
            sc.new_call()
        if drafting and self.has_drafter:
            off = on = None
            if self.session is not None:  # both probe states: capturing forwards cost more (the drafter skips
                off, on = self.target.probes(False), self.target.probes(True)  # those: nobody told it to read)
            k_max = max(self.k, self.tree, self.ngram_tree) if run.b == 1 else self.k
            eagle3 = next((sl.drafter for sl in self.drafters.slots if isinstance(sl.drafter, Eagle3Drafter)), None)
            t_cost = time.perf_counter()
            self.cost.ensure(run.b, k_max, eagle3, off, on)
            run.setup_s += time.perf_counter() - t_cost  # once per model and machine: not what drafting costs a call
        for slot in self.drafters.slots if run.model_drafters else []:
            slot.feeder.prepare(run.b, run.cap)
            if hasattr(slot.feeder, "bind_run"):  # a drafter that reads the target's own cache (layer skip)
                slot.feeder.bind_run(run)
        if drafting and self.ngram is not None:
            run.ngram = [self.ngram.index(run.toks[r, : run.lens[r]].tolist()) for r in range(run.b)]
        if streamer is not None:
            streamer.put(input_ids.cpu())
        return run

    def prefill(self, run: Run) -> None:
        """The prompt's forward: every row's first token, and the first feed of the model drafters."""
        tv = time.perf_counter()
        if self.session is not None:  # the drafter wants the prompt's features, unless every model drafter rests
            self.target.capture(self.target.awake(run, self.cost, self.k))
        mask, pos = run.prefill_inputs()
        run.seq_ids = self.session.new_seq_ids(run.b) if self.session is not None else None
        logits = self.target.forward(run, run.input_ids.to(run.device), pos, mask, phase="prefill")[:, -1]
        first = self._choose(run, logits).tolist()
        run.start(first)
        run.stats.prefill_s += time.perf_counter() - tv
        run.stats.target_forwards += 1
        run.stats.emitted = run.b
        readers = self.drafters.readers(self.target.capturing)
        if readers:
            lens = torch.tensor(run.lens)
            run.add_feed((self.target.step, torch.zeros_like(lens), lens - 1), readers)
        if run.ngram is not None:
            for r, t in enumerate(first):
                run.ngram[r].extend([t])
        if run.streamer is not None:
            run.streamer.put(torch.tensor(first))

    def _rounds(self, run: Run, auto: bool, t0: float) -> tuple[int, float] | None:
        """Rounds until every row is done; (tokens, seconds) of the speculative part if the call handed the rest
        over to plain decoding."""
        if self.tree and run.b > 1:
            log.warning("tree drafts are verified at batch 1 only; this batch of %d verifies chains", run.b)
        t_decode = time.perf_counter()
        spec_part = None
        while run.any_active():
            if not run.drafting:
                plain_round(run, self.target)
                continue
            plain_s = self.target.plain_s.get(run.b) if run.plain_graph else None
            if auto and losing(run, t_decode, self.cost, plain_s):  # the rest as plain steps, on this call's cache
                spec_part = (run.stats.emitted, time.perf_counter() - t0 - run.setup_s)
                if loop_plain(run.device):
                    run.drafting, run.handed, run.ngram = False, True, None  # no more drafts: no index to grow
                    if run.plain_graph and not isinstance(run.cache, StaticLoopCache):
                        self.target.go_static(run)  # (its cache copied onto a static one: compiled plain steps)
                    continue
                hand_over(run, self.target)
                return spec_part
            if self.tree and run.b == 1 and run.model_drafters:
                tree_round(run, self.target, self.drafters.slots[run.cur].feeder, self.cost, self.k, self.tree,
                           self.tree_top_k)
                continue
            self._round(run)
        return spec_part

    def _round(self, run: Run) -> None:
        """One chain round: plan -> draft -> verify -> commit -> account (a widened n-gram chain verifies as a
        tree)."""
        t_round = time.perf_counter()
        plan = plan_round(run, self.drafters, self.cost, self.k, self.target.capturing) if self.has_drafter else None
        drafts = RoundDrafts.plain(run) if plan is None else \
            draft_round(run, plan, self.drafters, self.target, self.cost, self.k)
        if self.ngram_tree:  # batch 1: the chosen chain and its free candidates in one tree, where that pays
            widened = widen(run, drafts, self.cost, self.k, self.ngram_tree, self.target.capturing)
            if widened is not None:
                ngram_tree_round(run, self.target, drafts, widened, t_round, self.cost, self.k, self.drafters)
                return
        t_verify = time.perf_counter()
        slot = self.drafters.slots[run.cur] if len(self.drafters) > 0 else None
        logits = forward_round(run, drafts, self.target, slot.feeder if slot else None, self.cost, self.k)
        n_acc, nxt = verify_round(run, drafts, logits, slot.d2t if slot else None)
        readers = self.drafters.readers(self.target.capturing)  # the model drafters that read this forward
        kept = run.keep(n_acc, nxt, drafts.tokens, self.target.step if readers else None, readers)
        account(run, drafts, n_acc, kept, (t_round, t_verify), self.cost if self.has_drafter else None,
                self.target.capturing)

    @staticmethod
    def _choose(run: Run, logits: torch.Tensor) -> torch.Tensor:
        if run.mode == "greedy":
            return logits.argmax(-1)
        return verify.sample(verify.target_probs(logits, run.temperature, run.top_k, run.top_p), run.gen)
