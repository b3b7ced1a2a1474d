"""Speculative decoding as a subscriber of the probe bus.

    with SpeculativeDecoder(target, "auto") as spec:          # EAGLE-3 (if one ships) + n-gram, scheduled, k <= 8
        out = spec.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    out.sequences, out.stats.tau

Per round: the scheduler picks, per row, EAGLE-3, n-gram or nothing and the verify length
from measured costs and acceptance estimates; the target runs over [last, d1..dn] with
probes on the drafter's feature sites (phase `verify`); the drafter subscriber reads the
accepted positions' features off the bus when it next drafts; the loop verifies
losslessly, commits, and crops the target's KV cache. `schedule="fixed"` drafts exactly
k every round with the given drafter (the classic loop, kept for comparison).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch
from torch import nn

from ..drafters._eagle import Eagle3Drafter
from ..drafters._feeder import Drafts, Feeder, RoundDrafts
from ..drafters._medusa import MedusaFeeder
from ..drafters._ngram import NgramDrafter
from ..schedule._cost import NGRAM_PATHS, PATHS, CostModel
from ..schedule._sched import DraftPlan, RowFix, Scheduler
from ..target._compat import cache_kw
from ..target._packed import PackedLinears
from ..verify import sample, target_probs, verify_greedy_rows, verify_rows
from ._accounting import account
from ._ngram_tree import ngram_tree_round, widen
from ._plain import hand_over, loop_plain, losing, plain_call, plain_round
from ._probing import ProbeSwitch
from ._run import Run, SpecOutput, SpecStats, check_call, eos_list
from ._slots import open_slots
from ._tree_round import supports_tree, tree_round

__all__ = ["RoundDrafts", "SpecOutput", "SpecStats", "SpeculativeDecoder"]

log = logging.getLogger("decoder")

# Longest draft by default. The scheduler picks each round's length up to k from the cost curve, so with
# verify forwards of 2-9 tokens at 1.07x a one-token step (packed weights) a longer ceiling only adds options:
# batch 1 greedy, 24 prompts a set, 2 interleaved repeats, k = 5 / 8 / 10: stdlib 1.51 / 1.59 / 1.58x,
# third-party 1.72 / 1.78 / 1.82x, prose 1.84 / 1.83 / 1.85x (and 1.62 / 1.72x, 1.66 / 1.65x for k = 5 / 8 on
# 12 prompts). A fixed schedule drafts exactly k every round, where 5 stays the better length.
AUTO_K, FIXED_K = 8, 5


def inference(fn):  # noqa: ANN001, ANN201
    """Run a decoding call under `torch.inference_mode`, its output sequences copied out of it after.

    Why: inference mode skips the version counters and view tracking that `no_grad` keeps for every op, and a
    small model's forward is mostly per-op overhead: a one-token forward of the default target took 4.29 / 4.73
    ms against 4.75 / 5.07 under `no_grad` (2 runs, median of 10 x 50 alternating, 2-core VM). What the call
    creates (caches, the drafter's buffers) is an inference tensor, written only by later calls (inside the
    mode again). The sequences handed back are cloned outside it: an inference tensor cannot be saved for a
    backward pass, and a caller may well feed the output to a forward with gradients (a loss, a fine-tune)."""
    @functools.wraps(fn)
    def call(*args, **kwargs) -> SpecOutput:  # noqa: ANN002, ANN003
        with torch.inference_mode():
            out = fn(*args, **kwargs)
        return SpecOutput(out.sequences.clone(), out.stats)
    return call


class SpeculativeDecoder(ProbeSwitch):
    """drafter: an Eagle3Drafter, any other Feeder (`RemoteEagle`, Medusa/MTP/DSpark heads, a draft model, layer
    skip), a list of them (the scheduler picks one per round), an NgramDrafter, "auto" (EAGLE-3 if one ships
    with the target, or `eagle=` one drafter or a list, plus n-gram), or None (plain steps). k is the longest
    draft (default: AUTO_K scheduled, FIXED_K with schedule="fixed"); tree=N verifies draft trees of up to N
    nodes at batch 1 (EAGLE-3, Medusa)."""

    def __init__(self, target: nn.Module, drafter: Eagle3Drafter | Feeder | NgramDrafter | str | None = None, *,
                 k: int | None = None, ngram: NgramDrafter | None = None, eagle: Eagle3Drafter | Feeder | None = None,
                 endpoint: str | None = None, schedule: str = "auto", cost: CostModel | None = None,
                 tree: int = 0, tree_top_k: int = 4, packed: str = "all", ngram_tree: int = 12) -> None:
        if schedule not in ("auto", "fixed"):
            raise ValueError(f"schedule must be 'auto' or 'fixed', got {schedule!r}")
        self.cache_kw = cache_kw(target.forward)  # how this transformers release names the KV cache (`_compat.py`)
        if k is None:
            k = FIXED_K if schedule == "fixed" else AUTO_K
        if k < 1:
            raise ValueError(f"k (the longest draft) must be >= 1, got {k}")
        self.target, self.k = target, k
        self._packed = PackedLinears.of(target, packed)  # verify forwards' linear layers, packed once
        if drafter == "auto":
            if eagle is None:
                from ..drafters._checkpoint import DrafterError, load_drafter

                with contextlib.suppress(DrafterError):
                    eagle = load_drafter("default", target)
            self.eagle, self.ngram = eagle, ngram or NgramDrafter()
        elif isinstance(drafter, str):
            raise ValueError(f"drafter must be a drafter object, 'auto' or None, got {drafter!r}")
        else:
            self.ngram = drafter if isinstance(drafter, NgramDrafter) else None
            self.eagle = None if drafter is None or isinstance(drafter, NgramDrafter) else drafter
        if schedule == "fixed" and self.eagle is not None and self.ngram is not None:
            raise ValueError("schedule='fixed' drafts with one method; 'auto' chooses between EAGLE-3 and n-gram")
        self.sched = Scheduler(k, fixed=schedule == "fixed")
        self._cost = cost
        self._capturing = True
        self._toggle_s = 2e-3  # seconds to pause or resume the probes, measured as it happens (from a high guess)
        self._valid_on = torch.ones(1, 1, dtype=torch.bool)
        self._valid_off = torch.zeros(1, 1, dtype=torch.bool)
        drafters = list(self.eagle) if isinstance(self.eagle, list | tuple) else \
            ([] if self.eagle is None else [self.eagle])
        if len(drafters) > 1 and schedule == "fixed":
            raise ValueError("schedule='fixed' drafts with one method; 'auto' chooses among several drafters")
        self.session, self.slots = open_slots(target, drafters, endpoint)
        self._tried: set[int] = set()
        self.feeder: Feeder | None = None
        self._d2t = None
        if self.slots:
            self._use(None, 0)
        if ngram_tree < 0:
            raise ValueError(f"ngram_tree (most nodes of an n-gram tree) must be >= 0, got {ngram_tree}")
        self.ngram_tree = ngram_tree if self.ngram is not None and schedule == "auto" else 0
        if tree < 0 or tree_top_k < 1:
            raise ValueError(f"tree (most nodes) must be >= 0 and tree_top_k >= 1, got {tree}, {tree_top_k}")
        if tree and (len(self.slots) != 1 or not supports_tree(self.feeder)):
            raise ValueError("tree drafts need EAGLE-3 or Medusa heads, or the MTP block with attention (one drafter "
                             "that scores alternatives); use tree=0 for this drafter")
        if tree and not isinstance(self.eagle, (Eagle3Drafter, MedusaFeeder)):
            raise ValueError("tree drafts need the drafter in this process (Eagle3Drafter or MedusaFeeder)")
        self.tree, self.tree_top_k = tree, tree_top_k

    def path_key(self, batch: int, temperature: float) -> tuple:
        """Whose calls `cost.paths` compares: this batch, greedy or sampling, and this decoder's drafters."""
        drafters = "+".join(type(s.feeder).__name__ for s in self.slots)
        return (batch, "sample" if temperature > 0 else "greedy", f"{drafters}|ngram={self.ngram is not None}|"
                f"k={self.k}|tree={self.tree}|ngram_tree={self.ngram_tree}")

    @property
    def endpoint(self) -> str | None:
        """The probe session's endpoint (watch it with `probebus top`), or None without a feature-fed drafter."""
        return self.session.endpoint if self.session is not None else None

    @property
    def cost(self) -> CostModel:
        if self._cost is None:
            self._cost = CostModel.for_target(self.target, packed=self._packed.kind if self._packed else "none")
        return self._cost

    def packed_weights(self) -> contextlib.AbstractContextManager:
        """Around each of the loop's forwards: the target's linear layers with their weights packed once
        (`_packed.py`), where that applies."""
        return self._packed.active() if self._packed is not None else contextlib.nullcontext()

    def close(self) -> None:
        for slot in self.slots:  # first: the session then has no one to wait for at its end of stream
            slot.feeder.close()
        self.slots = []
        if self.session is not None:
            self.session.close()
            self.session = None

    def __enter__(self) -> SpeculativeDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the loop ---------------------------------------------------------------------
    @inference
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 32, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, seed: int | None = None, streamer: object = None) -> SpecOutput:
        """Greedy output equals `target.generate(do_sample=False)`; sampling follows the target's distribution
        exactly. `streamer` takes transformers' streamer interface (put(ids), end()); batch 1 only."""
        t0 = time.perf_counter()
        key = self.path_key(input_ids.shape[0], temperature)
        auto = not self.sched.fixed and seed is None and (self.feeder is not None or self.ngram is not None)
        path = self.cost.paths.pick(key, self._paths(input_ids.shape[0], temperature)) if auto else "spec"
        plain = path == "plain"
        if plain and not loop_plain(next(self.target.parameters()).device):
            out = plain_call(self, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, eos_token_id,
                              pad_token_id, streamer)
            self.cost.paths.observe(key, "plain", out.stats.tokens_per_s, out.stats.emitted)
            return out
        # a plain call on CPU: the loop's own plain rounds (`loop_plain`)
        run = self._start(input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed,
                          streamer, drafting=not plain, model_drafters=path == "spec")
        if self._packed is not None:
            t_pack = time.perf_counter()
            self._packed.refresh()  # weights changed since the last call are packed again
            run.setup_s += time.perf_counter() - t_pack  # (11 ms on the first call: not what drafting costs)
        try:
            self._prefill(run)
            spec_part = self._rounds(run, auto, t0)
        finally:
            self._capture(False)  # probes publish during this decoder's calls only (see `_capture`)
        run.stats.seconds = time.perf_counter() - t0
        run.stats.path = path
        if run.streamer is not None:
            run.streamer.end()
        if plain:
            run.stats.delegated = True
            self.cost.paths.observe(key, "plain", run.stats.tokens_per_s, run.stats.emitted)
        elif auto:  # what drafting achieved: a handed-over call counts its speculative part
            tokens, seconds = spec_part or (run.stats.emitted, run.stats.seconds)
            seconds -= run.setup_s
            self.cost.paths.observe(key, path, tokens / max(seconds, 1e-9), tokens)
        return SpecOutput(run.sequences(pad_token_id), run.stats)

    def _paths(self, batch: int, temperature: float) -> tuple[str, ...]:
        """The paths a call may take (`PathChoice`). A sampled call at batch 1 with a model drafter and n-gram
        lookup may also run n-gram alone, probes off: at T = 0.8 the model drafter's drafts are rarely accepted
        (EAGLE-3's first draft 38 % on the default target), and its steps and the probes' capture cost a round
        ~0.6 ms of ~6 that per-round consults, judged on the drafter's own confidence, did not win back. Not at
        batch 8: a round of n-gram drafts there cost 11-13 ms against 6.6-7.3 for a plain round (n-gram alone
        0.78-0.83x on every set), so measuring that path only costs calls."""
        if temperature > 0 and batch == 1 and self.feeder is not None and self.ngram is not None:
            return NGRAM_PATHS
        return PATHS

    def _rounds(self, run: Run, auto: bool, t0: float) -> tuple[int, float] | None:
        """Draft, verify and commit until every row is done; (tokens, seconds) of the speculative part if the
        call handed the rest over to `generate`."""
        if self.tree and run.b > 1:
            log.warning("tree drafts are verified at batch 1 only; this batch of %d verifies chains", run.b)
        t_decode = time.perf_counter()
        spec_part = None
        while run.any_active():
            if not run.drafting:
                plain_round(self, run)
                continue
            if auto and losing(self, run, t_decode):  # the rest as plain steps, on this call's cache
                spec_part = (run.stats.emitted, time.perf_counter() - t0 - run.setup_s)
                if loop_plain(run.device):
                    run.drafting, run.handed, run.ngram = False, True, None  # no more drafts: no index to grow
                    continue
                hand_over(self, run)
                return spec_part
            if self.tree and run.b == 1 and run.model_drafters:
                tree_round(self, run)
                continue
            tr = time.perf_counter()
            drafts = self._draft(run)  # schedule + draft: method and length per row
            widened = widen(self, run, drafts) if self.ngram_tree else None
            if widened is not None:  # batch 1, greedy: the chosen chain and its free candidates in one tree
                ngram_tree_round(self, run, drafts, widened, tr)
                continue
            tv = time.perf_counter()
            logits = self._forward(run, drafts)  # verify
            n_acc, nxt = self._accept(run, drafts, logits)
            kept = self._commit(run, drafts, n_acc, nxt)
            account(self, run, drafts, n_acc, kept, tr, tv)
        return spec_part

    # --- pieces ---------------------------------------------------------------------------
    def _start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int,
               temperature: float, top_k: int | None, top_p: float | None, eos: int | list[int] | None,
               seed: int | None, streamer: object, drafting: bool = True, model_drafters: bool = True) -> Run:
        """The call's state; with `drafting` False (plain rounds only) no cost curve, drafter buffers or n-gram
        index are set up, and with `model_drafters` False (n-gram alone) no drafter buffers."""
        check_call(input_ids, max_new_tokens, streamer)
        param = next(self.target.parameters())
        device = param.device
        eos_ids = eos_list(eos)
        run = Run(input_ids, attention_mask, max_new_tokens=max_new_tokens, k=self.k, eos=eos_ids, device=device,
                  dtype=param.dtype)
        run.temperature, run.top_k, run.top_p, run.streamer = temperature, top_k, top_p, streamer
        run.gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        run.drafting, run.handed = drafting, False
        run.model_drafters = drafting and model_drafters  # False: no model drafter is asked, the probes stay off
        run.mode = "sample" if temperature > 0 else "greedy"
        # A seed reproduces the output: the schedule then depends on nothing timed or learned in earlier calls
        # (priors and the cost curve as loaded); unseeded calls adapt to measured time and keep what they learn.
        run.seeded = seed is not None
        if not run.seeded:
            run.scheds = self._scheds
        else:  # fresh state per slot: nothing learned in earlier calls changes a seeded call's schedule
            run.scheds = [Scheduler(self.k, fixed=self.sched.fixed) for _ in self._scheds]
            for sc in run.scheds[1:]:
                sc.ngram_calib = run.scheds[0].ngram_calib
        for sc in run.scheds:
            sc.new_call()
        run.fixes = [RowFix(run.b) for _ in run.scheds]
        run.fix = {"eagle": run.fixes[0], "ngram": RowFix(run.b)}
        run.sched = run.scheds[0]
        run.feeds_by = [[] for _ in run.scheds]
        run.tried = set()
        run.cur = 0
        run.feeds = run.feeds_by[0]
        if drafting and (self.feeder is not None or self.ngram is not None):
            off = on = None
            if self.session is not None:  # both probe states: capturing forwards cost more (the drafter skips
                off, on = self._probes(False), self._probes(True)  # their captures: nobody told it to read them)
            k_max = max(self.k, self.tree, self.ngram_tree) if run.b == 1 else self.k
            eagle3 = next((sl.drafter for sl in self.slots if isinstance(sl.drafter, Eagle3Drafter)), None)
            t_cost = time.perf_counter()
            self.cost.ensure(run.b, k_max, eagle3, off, on)
            run.setup_s = time.perf_counter() - t_cost  # once per model and machine: not what drafting costs a call
        for slot in self.slots if run.model_drafters else []:
            slot.feeder.prepare(run.b, run.cap)
            if hasattr(slot.feeder, "bind_run"):  # a drafter that reads the target's own cache (layer skip)
                slot.feeder.bind_run(run)
        if self.slots:
            self._use(run, 0)
        if drafting and self.ngram is not None:
            run.ngram = [self.ngram.index(run.toks[r, : run.lens[r]].tolist()) for r in range(run.b)]
        if streamer is not None:
            streamer.put(input_ids.cpu())
        return run

    def _prefill(self, run: Run) -> None:
        tv = time.perf_counter()
        if self.session is not None:  # the drafter wants the prompt's features, unless EAGLE-3 rests anyway
            self._capture(self._awake(run))
        mask, pos = run.prefill_inputs()
        run.seq_ids = self.session.new_seq_ids(run.b) if self.session is not None else None
        with self._context("prefill", run), self.packed_weights():
            logits = self.target(run.input_ids.to(run.device), attention_mask=mask, position_ids=pos,
                                 **{self.cache_kw: run.cache}, use_cache=True).logits[:, -1]
        first = self._choose(run, logits).tolist()
        run.start(first)
        run.stats.prefill_s += time.perf_counter() - tv
        run.stats.target_forwards += 1
        run.stats.emitted = run.b
        if self.feeder is not None and self._capturing:
            lens = torch.tensor(run.lens)
            run.add_feed((self.session.step if self.session is not None else 0, torch.zeros_like(lens), lens - 1))
        if run.ngram is not None:
            for r, t in enumerate(first):
                run.ngram[r].extend([t])
        if run.streamer is not None:
            run.streamer.put(torch.tensor(first))

    def _draft(self, run: Run) -> RoundDrafts:
        b, k = run.b, self.k
        plain = RoundDrafts(run.no_drafts, [0] * b, ["none"] * b)
        if self.feeder is None and self.ngram is None:
            return plain
        active = run.active()
        props, match, overlap = [[] for _ in range(b)], [0] * b, [0.0] * b
        if run.ngram is not None:
            for r in range(b):
                if active[r]:
                    props[r], match[r] = run.ngram[r].propose(k)
                    overlap[r] = run.ngram[r].overlap
        caps = [k if a else -1 for a in active] if self.sched.fixed else run.caps(k)
        fix = run.fix["ngram"].scale()
        base = run.sched.ngram_prefix(props, match, overlap, fix, run.mode) if run.ngram is not None \
            else [[0.0]] * b  # (every slot's scheduler shares the n-gram calibration)
        ctx = Scheduler.context(base, caps)  # what n-gram offers: whether asking EAGLE-3 pays is learnt per band
        consult = self.feeder is not None and run.model_drafters and self._pick(run, ctx)
        sched, frozen = run.sched, run.seeded
        if not consult and not any(props):  # nothing to weigh: a plain step, without building a plan
            return plain
        e_scale = run.fix["eagle"].scale()
        calib = sched.eagle_calib[run.mode]
        curve = self.cost.curve(b, k, frozen, capturing=self._capturing and not frozen)
        plain = 1.0 / curve[0]  # the last row's tokens per second in plain steps
        rate = plain if frozen else max(plain, run.rate() / max(sum(active), 1))
        plan = DraftPlan(k, curve, self.cost.step(b, frozen), rate, base, caps, calib.table(), sched.fixed,
                         run.ahead(), row_scale=e_scale)
        eagle, prefix = None, None
        if consult:
            seed = run.draft_seed() if run.mode == "sample" else None
            with self._quiet(run):
                eagle = self.feeder.draft(run.take_feeds(), run.toks, k, run.temperature, seed, plan)
            run.stats.by_drafter[self.slots[run.cur].name] = run.stats.by_drafter.get(self.slots[run.cur].name, 0) + 1
            prefix = []
            for r, conf in enumerate(eagle.conf.tolist()):
                pref, cum = [0.0], 1.0
                for c in conf:
                    cum *= plan.conditional(c, r)
                    pref.append(pref[-1] + cum)
                prefix.append(pref)
            run.stats.bus_s += eagle.bus_s
        n_eagle = eagle.tokens.shape[1] if eagle is not None else 0
        choice = sched.choose(plan, prefix, props, n_eagle)
        if eagle is not None and not sched.fixed:  # did asking EAGLE-3 pay for its own time (probes included)?
            spent = plan.step_cost * n_eagle if frozen else \
                eagle.bus_s + eagle.compute_s + self.cost.capture_tax(b, choice.length)
            sched.consulted(plan.best(prefix)[0] - plan.best(None)[0] - plan.rate * spent, ctx)
        return self._assemble(run, choice, eagle, props, match, overlap)

    def _assemble(self, run: Run, choice, eagle: Drafts | None, props: list[list[int]], match: list[int],  # noqa: ANN001
                  overlap: list[float]) -> RoundDrafts:
        b, n = run.b, choice.length - 1
        tokens = torch.zeros(b, n, dtype=torch.long)
        ids = q = None
        sampled = [False] * b
        use_eagle = eagle is not None and "eagle" in choice.methods
        if use_eagle:
            s = min(n, eagle.tokens.shape[1])
            tokens[:, :s] = eagle.tokens[:, :s].cpu()
            ids = torch.zeros(b, n, dtype=torch.long)
            ids[:, :s] = eagle.ids[:, :s].cpu()
            if eagle.q is not None:
                q = torch.zeros(b, n, eagle.q.shape[-1], dtype=eagle.q.dtype, device=eagle.q.device)
                q[:, :s] = eagle.q[:, :s]
                sampled = [m == "eagle" for m in choice.methods]
        for r, m in enumerate(choice.methods):
            if m == "ngram":
                p = props[r][: choice.k_rows[r]]
                tokens[r, : len(p)] = torch.tensor(p, dtype=torch.long)
        return RoundDrafts(tokens, choice.k_rows, choice.methods, ids, q, sampled, eagle, props, match, overlap)

    def _forward(self, run: Run, drafts: RoundDrafts) -> torch.Tensor:
        verify = getattr(self.feeder, "verify_from_draft", None)  # layer skip verifies from where its draft left off
        if verify is not None:
            logits = verify(run, drafts.tokens, reuse=self.session is None)  # probes must see every layer
            if logits is not None:
                return logits
        inp, positions, mask = run.inputs(drafts.tokens)
        if self.session is not None:  # EAGLE-3 resting for a while: take the probes off the model meanwhile
            self._capture(self._awake(run))
        with self._context("verify", run, positions), self.packed_weights():
            return self.target(inp, attention_mask=mask, position_ids=positions,
                               **{self.cache_kw: run.cache}, use_cache=True).logits

    def _accept(self, run: Run, drafts: RoundDrafts, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        if run.mode == "greedy" and run.b == 1:  # one argmax and a list walk: a third of the tensor path's time
            best = logits[0].argmax(-1).tolist()
            d, n = drafts.tokens[0, : max(drafts.k_rows[0], 0)].tolist(), 0
            while n < len(d) and d[n] == best[n]:
                n += 1
            return [n], [best[n]]
        dev = logits.device
        k_rows = torch.tensor(drafts.k_rows, device=dev)
        tokens = drafts.tokens.to(dev)
        if run.mode == "greedy":
            n_acc, nxt = verify_greedy_rows(tokens, k_rows, logits)
        else:
            p = target_probs(logits, run.temperature, run.top_k, run.top_p)
            d2t = self._d2t.to(dev) if drafts.q is not None else None
            q = drafts.q.to(dev) if drafts.q is not None else None
            ids = drafts.ids.to(dev) if drafts.ids is not None else None
            n_acc, nxt = verify_rows(tokens, k_rows, p, q, ids, d2t, torch.tensor(drafts.sampled or [False] * run.b,
                                                                                  device=dev), run.gen)
        return n_acc.tolist(), nxt.tolist()

    def _commit(self, run: Run, drafts: RoundDrafts, n_acc: list[int], nxt: list[int]) -> list[list[int]]:
        kept = run.commit(n_acc, nxt, drafts.tokens)
        run.stats.target_forwards += 1
        step = self.session.step if self.session is not None else 0
        feed = self.feeder is not None and self._capturing
        span = run.advance(feed)
        if span is not None:
            run.add_feed((step, *span))
        if run.ngram is not None:
            for r, t in enumerate(kept):
                if t:
                    run.ngram[r].extend(t)
        if run.streamer is not None and kept[0]:
            run.streamer.put(torch.tensor(kept[0]))
        return kept

    @property
    def _scheds(self) -> list[Scheduler]:
        """One scheduler state per model drafter (the n-gram calibration is shared); the first is `self.sched`."""
        if len(getattr(self, "_slot_scheds", [])) != max(len(self.slots), 1):
            self._slot_scheds = [self.sched] + [Scheduler(self.k, fixed=self.sched.fixed)
                                                for _ in range(len(self.slots) - 1)]
            for sc in self._slot_scheds[1:]:
                sc.ngram_calib = self.sched.ngram_calib
        return self._slot_scheds

    def _use(self, run: Run | None, i: int) -> None:
        """Put slot i's drafter, vocabulary map and (for a call) scheduler state and feeds in the round's hands."""
        slot = self.slots[i]
        self.eagle, self.feeder, self._d2t = slot.drafter, slot.feeder, slot.d2t
        if run is not None:
            run.cur, run.sched, run.fix["eagle"] = i, run.scheds[i], run.fixes[i]
            run.feeds = run.feeds_by[i]

    def _pick(self, run: Run, ctx: int = 0) -> bool:
        """Which model drafter this round consults, if any: every slot's wait counts down each round; among the
        slots ready, one never tried first, then the one whose consults paid best lately. The others drain
        their features off the bus so it never backs up."""
        ready = [i for i, sc in enumerate(run.scheds) if sc.consult_eagle(ctx)]
        if ready:
            tried = run.tried if run.seeded else self._tried  # a seeded call depends on nothing learned earlier
            i = max(ready, key=lambda j: (j not in tried, run.scheds[j].net[ctx]))
            tried.add(i)
            self._use(run, i)
        for j, slot in enumerate(self.slots):
            if (not ready or j != run.cur) and len(run.feeds_by[j]) >= 8:
                feeds, run.feeds_by[j] = run.feeds_by[j], []
                if run.cur == j:
                    run.feeds = run.feeds_by[j]
                run.stats.bus_s += slot.feeder.draft(feeds, run.toks, 0, run.temperature, None, None).bus_s
        return bool(ready)

    @staticmethod
    def _choose(run: Run, logits: torch.Tensor) -> torch.Tensor:
        if run.mode == "greedy":
            return logits.argmax(-1)
        p = target_probs(logits, run.temperature, run.top_k, run.top_p)
        return sample(p, run.gen)
