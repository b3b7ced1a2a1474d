"""A chain round's stages before its commit: plan (the n-gram proposals, the scheduler's plan, which model drafter
to ask), draft (ask it; choose per row between its drafts, the n-gram proposal and nothing), verify (the target's
forward over [last, d1..dn] and the acceptance rule). The decoder's round runs them, then `Run.keep` and
`account`.

    plan = plan_round(run, drafters, cost, k, capturing)      # None: nothing to weigh, a plain step
    drafts = draft_round(run, plan, drafters, target, cost, k) if plan else RoundDrafts.plain(run)
    logits = forward_round(run, drafts, target, feeder, cost, k)
    n_acc, nxt = verify_round(run, drafts, logits, d2t)

What the scheduler weighs and why is `schedule/_sched.py`; this module feeds it the round's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import verify
from ..drafters import Drafts, Feeder
from ..schedule import Choice, CostModel, DraftPlan, Scheduler
from ._drafters import ModelDrafters
from ._run import Run
from ._target import Target


@dataclass
class RoundDrafts:
    """What one round verifies: drafts [B, L-1] (row r offers k_rows[r]) and what the scheduler knew."""

    tokens: torch.Tensor
    k_rows: list[int]
    methods: list[str]  # per row: "model", "ngram" or "none"
    ids: torch.Tensor | None = None  # draft-vocabulary ids (the model drafter's rows)
    q: torch.Tensor | None = None  # [B, L-1, draft_vocab] for rows that sampled from the model drafter
    sampled: list[bool] | None = None
    model: Drafts | None = None  # everything the model drafter proposed this round (for calibration)
    props: list[list[int]] | None = None  # n-gram proposals, match lengths, overlaps
    match: list[int] | None = None
    overlap: list[float] | None = None

    @classmethod
    def plain(cls, run: Run) -> RoundDrafts:
        """Nothing drafted: a plain step of every row."""
        return cls(run.no_drafts, [0] * run.b, ["none"] * run.b)


@dataclass
class RoundPlan:
    """The n-gram proposal per row, the round's band (`Scheduler.context`), whether a model drafter is asked
    (`run.cur` says which), and the plan its stopping rule and the choice follow."""

    props: list[list[int]]
    match: list[int]
    overlap: list[float]
    ctx: int
    consult: bool
    plan: DraftPlan


def plan_round(run: Run, drafters: ModelDrafters, cost: CostModel, k: int, capturing: bool) -> RoundPlan | None:
    b = run.b
    active = run.active()
    props, match, overlap = [[] for _ in range(b)], [0] * b, [0.0] * b
    if run.ngram is not None:
        for r in range(b):
            if active[r]:
                props[r], match[r] = run.ngram[r].propose(k)
                overlap[r] = run.ngram[r].overlap
    caps = [k if a else -1 for a in active] if run.sched.fixed else run.caps(k)
    base = run.sched.ngram_prefix(props, match, overlap, run.ngram_fix.scale(), run.mode) if run.ngram is not None \
        else [[0.0]] * b  # (every slot's scheduler shares the n-gram calibration)
    ctx = Scheduler.context(base, caps)  # what n-gram offers: whether asking a model drafter pays is learnt per band
    consult = len(drafters) > 0 and run.model_drafters and drafters.pick(run, ctx)
    if not consult and not any(props):  # nothing to weigh: a plain step, without building a plan
        return None
    sched, frozen = run.sched, run.seeded
    curve = cost.curve(b, k, frozen, capturing=capturing and not frozen)
    plain = 1.0 / curve[0]  # the last row's tokens per second in plain steps
    rate = plain if frozen else max(plain, run.rate() / max(sum(active), 1))
    plan = DraftPlan(k, curve, cost.step(b, frozen), rate, base, caps, sched.model_calib[run.mode].table(),
                     sched.fixed, run.ahead(), row_scale=run.model_fix.scale())
    return RoundPlan(props, match, overlap, ctx, consult, plan)


def draft_round(run: Run, rp: RoundPlan, drafters: ModelDrafters, target: Target, cost: CostModel,
                k: int) -> RoundDrafts:
    """Ask the chosen model drafter (its own stopping rule on `rp.plan`), then choose per row; learn whether
    asking it paid for its own time (probes included)."""
    sched, plan = run.sched, rp.plan
    model, prefix = None, None
    if rp.consult:
        slot = drafters.slots[run.cur]
        seed = run.draft_seed() if run.mode == "sample" else None
        with target.quiet(run, reads_features=bool(slot.sites)):
            model = slot.feeder.draft(run.take_feeds(), run.toks, k, run.temperature, seed, plan)
        run.stats.by_drafter[slot.name] = run.stats.by_drafter.get(slot.name, 0) + 1
        prefix = []
        for r, conf in enumerate(model.conf.tolist()):
            pref, cum = [0.0], 1.0
            for c in conf:
                cum *= plan.conditional(c, r)
                pref.append(pref[-1] + cum)
            prefix.append(pref)
        run.stats.bus_s += model.bus_s
    n_model = model.tokens.shape[1] if model is not None else 0
    choice = sched.choose(plan, prefix, rp.props, n_model)
    if model is not None and not sched.fixed:
        spent = plan.step_cost * n_model if run.seeded else \
            model.bus_s + model.compute_s + cost.capture_tax(run.b, choice.length)
        sched.consulted(plan.best(prefix)[0] - plan.best(None)[0] - plan.rate * spent, rp.ctx)
    return _assemble(run, choice, model, rp)


def _assemble(run: Run, choice: Choice, model: Drafts | None, rp: RoundPlan) -> RoundDrafts:
    b, n = run.b, choice.length - 1
    tokens = torch.zeros(b, n, dtype=torch.long)
    ids = q = None
    sampled = [False] * b
    if model is not None and "model" in choice.methods:
        s = min(n, model.tokens.shape[1])
        tokens[:, :s] = model.tokens[:, :s].cpu()
        ids = torch.zeros(b, n, dtype=torch.long)
        ids[:, :s] = model.ids[:, :s].cpu()
        if model.q is not None:
            q = torch.zeros(b, n, model.q.shape[-1], dtype=model.q.dtype, device=model.q.device)
            q[:, :s] = model.q[:, :s]
            sampled = [m == "model" for m in choice.methods]
    for r, m in enumerate(choice.methods):
        if m == "ngram":
            p = rp.props[r][: choice.k_rows[r]]
            tokens[r, : len(p)] = torch.tensor(p, dtype=torch.long)
    return RoundDrafts(tokens, choice.k_rows, choice.methods, ids, q, sampled, model, rp.props, rp.match, rp.overlap)


def forward_round(run: Run, drafts: RoundDrafts, target: Target, feeder: Feeder | None, cost: CostModel,
                  k: int) -> torch.Tensor:
    """The target's logits [B, L, V] over each row's [last, drafts]: probes on while a model drafter may read them
    (`Target.awake`). Layer skip verifies from where its draft left off (its own shortcut), unless probes must see
    every layer."""
    verify_from_draft = getattr(feeder, "verify_from_draft", None)
    if verify_from_draft is not None:
        logits = verify_from_draft(run, drafts.tokens, reuse=target.session is None)
        if logits is not None:
            return logits
    inp, positions, mask = run.inputs(drafts.tokens)
    if target.session is not None:  # a model drafter resting for a while: the probes come off meanwhile
        target.capture(target.awake(run, cost, k))
    return target.forward(run, inp, positions, mask)


def verify_round(run: Run, drafts: RoundDrafts, logits: torch.Tensor,
                 d2t: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """(drafts accepted, next token) per row by the call's rule (`decoder.verify`); d2t: the model drafter's
    draft-to-target vocabulary map, for rows that sampled from its q."""
    if run.mode == "greedy":
        return verify.verify_chain_greedy(drafts.tokens, drafts.k_rows, logits)
    dev = logits.device
    p = verify.target_probs(logits, run.temperature, run.top_k, run.top_p)
    q = drafts.q.to(dev) if drafts.q is not None else None
    d2t = d2t.to(dev) if q is not None else None
    ids = drafts.ids.to(dev) if drafts.ids is not None else None
    sampled = torch.tensor(drafts.sampled or [False] * run.b, device=dev)
    n_acc, nxt = verify.verify_chain_sampled(drafts.tokens.to(dev), torch.tensor(drafts.k_rows, device=dev), p, q,
                                             ids, d2t, sampled, run.gen)
    return n_acc.tolist(), nxt.tolist()
