"""A model drafter as a bus subscriber (EAGLE-3, the MTP block): features in, drafts out.

    feeder = EagleFeeder(drafter, session.endpoint)      # or RemoteEagle(address): the same Feeder protocol
    feeder.prepare(batch, max_len)
    drafts = feeder.draft(feeds, toks, k, temperature, seed, plan)

`feeds` lists the forwards since the last call as (step, start [B], end [B]): row r
accepted positions start[r]..end[r] of forward `step`. The feeder takes those rows of
the drafter's captures (EAGLE-3's three `resid_pre`) off the bus, runs the drafter over all of them at once
(lazily: a round that does not draft costs only the bus), then proposes up to k tokens
by feeding its own output back, one step at a time, stopping when `plan` says another
step would not pay. With k = 0 it only drains the bus.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

import probe

from ..schedule import DraftPlan
from ..verify import sample
from ._eagle import Eagle3Drafter


@dataclass
class Drafts:
    """tokens/ids [B, s] (target and draft-vocabulary ids), conf [B, s] raw acceptance estimates,
    q [B, s, draft_vocab] when sampled (None for argmax drafts), and where the time went."""

    tokens: torch.Tensor
    ids: torch.Tensor
    conf: torch.Tensor
    q: torch.Tensor | None
    bus_s: float = 0.0
    compute_s: float = 0.0
    step_s: float = 0.0  # seconds one more draft token costs (a step and its bookkeeping); 0: not measured

    @classmethod
    def empty(cls, batch: int, bus_s: float = 0.0) -> Drafts:
        z = torch.zeros(batch, 0, dtype=torch.long)
        return cls(z, z, torch.zeros(batch, 0), None, bus_s, 0.0)


Feed = tuple  # (step, start [B], end [B]) or, after a tree round, (step, start, end, (base, real positions))


def tree_positions(positions: torch.Tensor, remap: tuple[int, torch.Tensor] | None) -> torch.Tensor:
    """Real positions of a forward's captures. A tree forward labels node j with position base + j (nodes at the
    same depth share a real position); `real[j]` is node j's real position on the accepted path, -1 off it."""
    if remap is None:
        return positions
    base, real = remap
    return real[(positions - base).clamp(0, len(real) - 1)]


class Feeder(Protocol):
    """What the loop needs from a feature-fed drafter, in its own process or another."""

    config: object  # .aux_layer_ids

    def connect(self, endpoint: str) -> None: ...
    def prepare(self, batch: int, max_len: int) -> None: ...
    def draft(self, feeds: list[Feed], toks: torch.Tensor, k: int, temperature: float, seed: int | None,
              plan: DraftPlan | None) -> Drafts: ...
    def close(self) -> None: ...


def feature_sites(drafter: object) -> list[str]:
    """The probe sites a drafter reads: EAGLE-3's three `resid_pre` layers, a drafter's own `sites`, or none."""
    if drafter is None:
        return []
    if hasattr(drafter, "sites"):
        return list(drafter.sites)
    return [f"layers.{i}.resid_pre" for i in drafter.config.aux_layer_ids]


class EagleFeeder:
    """every_site: the session publishes no site this drafter does not read, so it subscribes to everything.
    A subscription per site makes the publisher send each capture as its own message; with none, a step's
    captures go as one bundle (one ZeroMQ send a forward instead of three on the model's thread)."""

    def __init__(self, drafter: Eagle3Drafter, endpoint: str | None = None, every_site: bool = False) -> None:
        self.drafter = drafter
        self.every_site = every_site
        self.config = drafter.config
        self.sites = feature_sites(drafter)  # EAGLE-3's three resid_pre layers; the MTP block's final_norm
        self._slot = {s: i for i, s in enumerate(self.sites)}
        self.sub: probe.Subscriber | None = None
        self.d2t = drafter.draft_to_target_ids()  # target id of each draft id (the tree builders read it too)
        self.step = drafter.fast()  # the drafter's step (the tree builders run it on their frontier rows)
        self._body = getattr(self.step, "body", None)  # EAGLE-3's step: layer and head apart
        if endpoint is not None:
            self.connect(endpoint)

    def connect(self, endpoint: str) -> None:
        # live: each round needs the forward it follows
        self.sub = probe.Subscriber(endpoint, None if self.every_site else self.sites, live=True)

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close()
            self.sub = None

    def prepare(self, batch: int, max_len: int) -> None:
        p = next(self.drafter.parameters())
        h = self.drafter.config.target_hidden_size
        self.feats = torch.zeros(batch, max_len, len(self.sites) * h, dtype=p.dtype, device=p.device)
        self.cache = self.drafter.new_cache(batch, max_len)
        self.seq_base: int | None = None
        self.lo: torch.Tensor | None = None  # per row: first position collected but not yet run
        self.hi: torch.Tensor | None = None  # per row: last position collected
        self.fed_end: torch.Tensor | None = None  # per row: last position the drafter ran on
        self.ready = False
        self._no_conf = torch.full((batch,), 0.5, device=p.device)

    # --- features in ---------------------------------------------------------------------
    def _collect(self, feeds: list[Feed]) -> None:
        if self.sub is None:
            raise RuntimeError("the drafter is not connected to a probe session (connect(endpoint) first)")
        for feed in feeds:
            step, start, end = feed[:3]
            self._collect_step(step, start, end, feed[3] if len(feed) > 3 else None)
            self.lo = start.clone() if self.lo is None else torch.minimum(self.lo, start)
            self.hi = end.clone()

    def _collect_step(self, step: int, start: torch.Tensor, end: torch.Tensor,
                      remap: tuple[int, torch.Tensor] | None = None) -> None:
        h = self.drafter.config.target_hidden_size
        got: set[str] = set()
        one = start.shape[0] == 1 and remap is None  # batch 1: slices instead of masks and index tensors
        s, e = (int(start[0]), int(end[0])) if one else (0, 0)
        while len(got) < len(self.sites):
            cap = self.sub.recv(timeout=30)
            if cap is None:
                raise RuntimeError(f"no features for forward {step} arrived from the probe bus within 30 s")
            if cap.step < step:  # an earlier forward nobody consumed (an aborted generate, a cost measurement)
                continue
            if cap.step > step:
                raise RuntimeError(f"features of forward {cap.step} arrived while waiting for forward {step}: "
                                   "the loop and the drafter disagree on the step count")
            i = self._slot.get(cap.site)
            if i is None:  # a site of another drafter (every_site is for sessions that have none)
                continue
            got.add(cap.site)
            if self.seq_base is None:
                self.seq_base = int(cap.seq_ids.min())
            if one and self._copy_run(cap, s, e, i * h, (i + 1) * h):
                continue
            r = cap.seq_ids - self.seq_base
            pos = tree_positions(cap.positions, remap)
            keep = (pos >= start[r]) & (pos <= end[r])
            dev = self.feats.device  # captures arrive on the host; a CUDA drafter's features live on its device
            src = cap.tensor[keep]
            self.feats[r[keep].to(dev), pos[keep].to(dev), i * h:(i + 1) * h] = src.to(dev, self.feats.dtype)

    def _copy_run(self, cap: probe.Capture, s: int, e: int, c0: int, c1: int) -> bool:
        """Batch 1: copy the capture's rows at positions s..e into columns c0:c1 of the features as one slice,
        if its rows are one sequence at consecutive positions (a verify or prefill forward); False otherwise
        (the masked copy then handles it). The masks and index tensors of the general copy were a large share
        of a round's feature intake at batch 1 (measured: docs/design.md, "Decoder: measurements behind the
        code")."""
        pos = cap.positions.tolist()
        n = len(pos)
        if not n or pos != list(range(pos[0], pos[0] + n)) or cap.seq_ids.tolist().count(self.seq_base) != n:
            return False
        lo, hi = max(s - pos[0], 0), min(e - pos[0], n - 1)
        if hi >= lo:
            self.feats[0, pos[0] + lo: pos[0] + hi + 1, c0:c1] = cap.tensor[lo: hi + 1]
        return True

    @torch.no_grad()
    def _catch_up(self, toks: torch.Tensor) -> None:
        """Run the drafter over every collected position not yet run; keep the last one's outputs."""
        start, end = self.lo, self.hi
        b = start.shape[0]
        if b == 1:
            return self._catch_up_one(toks, int(start[0]), int(end[0]))
        span = int((end - start).max()) + 1
        pos = torch.minimum(start[:, None] + torch.arange(span), end[:, None])  # ragged rows repeat their last
        rows = torch.arange(b)[:, None]
        # drop the slots drafted after the last position run (a gap, when the loop took the probes off for a
        # while, stays a gap: those positions were never captured)
        self.cache.truncate(start if self.fed_end is None else torch.minimum(start, self.fed_end + 1))
        d = self.drafter
        dev = self.feats.device
        pick = (end - start).to(dev)[:, None, None]
        self._run_to(d.fuse(self.feats[rows, pos]), toks[rows, pos + 1].to(dev), pos.to(dev), end,
                     lambda x: x.gather(1, pick.expand(b, 1, x.shape[-1])))

    def _catch_up_one(self, toks: torch.Tensor, s: int, e: int) -> None:
        """`_catch_up` at batch 1: positions s..e as slices, the cache truncated as one slice."""
        self.cache.valid[0, s if self.fed_end is None else min(s, int(self.fed_end[0]) + 1):] = False
        dev = self.feats.device
        pos = torch.arange(s, e + 1, device=dev)[None]
        self._run_to(self.drafter.fuse(self.feats[:, s: e + 1]), toks[:, s + 1: e + 2].to(dev), pos,
                     torch.tensor([e]), lambda x: x[:, -1:])

    def _run_to(self, hidden: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, end: torch.Tensor,
                pick: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Run the drafter over the positions (up to `end` per row) and keep `pick`'s position per row (the
        newest) as the state drafting starts from. A step with a separate head (EAGLE-3's) runs its norm and LM
        head only there."""
        span = int(end.max()) + 1
        if self._body is not None:
            self.h = pick(self._body(hidden, ids, pos, self.cache, span))
            self.hn, self.logits = self.step.head(self.h)
        else:
            self.h, self.hn, self.logits = (pick(x) for x in self.step(hidden, ids, pos, self.cache, span))
        self.fed_end = end
        self.lo = None
        self.ready = True

    # --- drafts out --------------------------------------------------------------------
    def absorb(self, feeds: list[Feed], toks: torch.Tensor, run: bool = True) -> float:
        """Take the feeds' features off the bus and (with `run`) run the drafter up to the newest; bus seconds."""
        t0 = time.perf_counter()
        if feeds:
            self._collect(feeds)
        bus_s = time.perf_counter() - t0
        if run:
            if self.lo is not None:
                self._catch_up(toks)
            if not self.ready:
                raise RuntimeError("draft() before any features were fed: the drafter has nothing to draft from")
        return bus_s

    @torch.no_grad()
    def draft(self, feeds: list[Feed], toks: torch.Tensor, k: int, temperature: float, seed: int | None,
              plan: DraftPlan | None = None) -> Drafts:
        t0 = time.perf_counter()
        bus_s = self.absorb(feeds, toks, run=k > 0)
        b = toks.shape[0]
        if k == 0:
            return Drafts.empty(b, bus_s)
        d = self.drafter
        gen = torch.Generator(device=self.feats.device).manual_seed(seed) if seed is not None else None
        head = d.confidence
        h, hn, logits = self.h, self.hn, self.logits
        pos0 = (self.fed_end + 1).to(self.feats.device)
        span = int(self.fed_end.max()) + 2
        tokens, ids, confs, qs = [], [], [], []
        prefix: list[list[float]] | None = None
        if plan is not None and not plan.fixed:
            prefix = [[0.0] for _ in range(b)]
            cum = [1.0] * b
        t_loop, stepping = time.perf_counter(), 0.0
        for i in range(k):
            lg = logits[:, 0]
            if temperature > 0:  # sample in the draft vocabulary: q never needs the target's full vocabulary
                q = (lg.float() / temperature).softmax(-1)
                did = sample(q, gen)
                qs.append(q)
            else:
                did = lg.argmax(-1)
            if prefix is None:  # the fixed-k loop decides nothing from it
                conf = self._no_conf[:b]
            elif head is not None:
                conf = head.score(hn[:, 0], lg, i)
            else:  # no head: the drafter's own probability of its top token
                conf = (lg.float().max(-1).values - torch.logsumexp(lg.float(), -1)).exp()
            tok = self.d2t[did]
            tokens.append(tok)
            ids.append(did)
            confs.append(conf)
            if i + 1 == k:
                break
            if prefix is not None and not plan.add_step(prefix, cum, conf.tolist()):
                break
            t_step = time.perf_counter()
            h, hn, logits = self.step(h, tok[:, None], pos0[:, None] + i, self.cache, span + i)
            stepping += time.perf_counter() - t_step
        # One more draft costs a step plus a draft's own bookkeeping; the intake and catch-up before the loop
        # are what a consult costs, not a longer draft (spread over the steps, they had doubled the estimate).
        n, end = len(tokens), time.perf_counter()
        step_s = stepping / (n - 1) + (end - t_loop - stepping) / n if n > 1 else 0.0
        stack = torch.stack
        return Drafts(stack(tokens, 1), stack(ids, 1), stack(confs, 1).float().cpu(),
                      stack(qs, 1) if qs else None, bus_s, end - t0 - bus_s, step_s)
