"""The model drafters of one decoder: one slot each (drafter, feeder, sites, vocabulary map, scheduler state), one
probe session for all, and which slot a round consults.

    drafters = ModelDrafters(model, [eagle, MTPFeeder(head)], endpoint=None, k=8, fixed=False)
    drafters.pick(run, ctx)                 # which slot this round consults, if any (`run.cur`)
    drafters.slots[run.cur].feeder.draft(...)

A slot's drafter with feature sites subscribes to the session (which probes the union of every
slot's sites); a drafter without sites (a draft model, layer skip) reads token ids only. Each
slot keeps its own scheduler state (calibration of its acceptance estimate, whether consulting
it pays), so the round scheduler can weigh several model drafters against each other and n-gram.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import probe

from ..drafters import Eagle3Drafter, EagleFeeder, Feeder, feature_sites
from ..schedule import Scheduler
from ._run import Run


@dataclass
class Slot:
    drafter: object  # what the caller passed (an Eagle3Drafter, a Feeder)
    feeder: Feeder  # what the loop calls (an EagleFeeder for an Eagle3Drafter)
    sites: list[str]
    d2t: torch.Tensor | None  # target id of each draft id (sampled drafts' q is over the draft vocabulary)
    name: str


class ModelDrafters:
    """scheds: one scheduler state per slot (at least one), kept across calls; they share the n-gram calibration.
    `tried`: the slots consulted so far (a slot never tried goes first)."""

    def __init__(self, target: nn.Module, drafters: list, endpoint: str | None, k: int, fixed: bool) -> None:
        self.session, self.slots = open_slots(target, drafters, endpoint)
        self.k, self.fixed = k, fixed
        self.scheds = self.fresh_scheds()
        self.tried: set[int] = set()

    def __len__(self) -> int:
        return len(self.slots)

    def fresh_scheds(self) -> list[Scheduler]:
        """One scheduler state per slot, learned nothing yet (a seeded call's, and the decoder's at the start)."""
        scheds = [Scheduler(self.k, fixed=self.fixed) for _ in range(max(len(self.slots), 1))]
        for sc in scheds[1:]:
            sc.ngram_calib = scheds[0].ngram_calib
        return scheds

    def pick(self, run: Run, ctx: int = 0) -> bool:
        """Which model drafter this round consults, if any (sets `run.cur`): every slot's wait counts down each
        round; among the slots ready, one never tried first, then the one whose consults paid best lately. The
        others drain their features off the bus so it never backs up."""
        ready = [i for i, sc in enumerate(run.scheds) if sc.consult_model(ctx)]
        if ready:
            tried = run.tried if run.seeded else self.tried  # a seeded call depends on nothing learned earlier
            run.cur = max(ready, key=lambda j: (j not in tried, run.scheds[j].net[ctx]))
            tried.add(run.cur)
        for j, slot in enumerate(self.slots):
            if (not ready or j != run.cur) and len(run.feeds_by[j]) >= 8:
                feeds, run.feeds_by[j] = run.feeds_by[j], []
                run.stats.bus_s += slot.feeder.draft(feeds, run.toks, 0, run.temperature, None, None).bus_s
        return bool(ready)

    def readers(self, capturing: bool) -> list[bool] | None:
        """Per slot, whether it reads the forward just run: a drafter of features only while the probes publish,
        one of token ids (a draft model, layer skip) always; None when none does."""
        readers = [capturing or not slot.sites for slot in self.slots]
        return readers if any(readers) else None

    def close(self) -> None:
        """The feeders first: the session then has no one to wait for at its end of stream (the decoder closes it)."""
        for slot in self.slots:
            slot.feeder.close()
        self.slots = []


def open_slots(target: nn.Module, drafters: list, endpoint: str | None) -> tuple[object, list[Slot]]:
    """(probe session or None, one Slot per drafter)."""
    for d in drafters:
        if hasattr(d, "check_target"):
            d.check_target(target)
    sites = list(dict.fromkeys(s for d in drafters for s in feature_sites(d)))
    if not sites and endpoint is not None:
        raise ValueError(f"endpoint={endpoint!r}: this drafter reads no features, so no probe session runs")
    session = probe.attach(target, sites, endpoint=endpoint) if sites else None
    slots = []
    for d in drafters:
        own = feature_sites(d)
        feeder = d
        if isinstance(d, Eagle3Drafter):
            feeder = EagleFeeder(d, session.endpoint, every_site=set(own) == set(sites))
        elif own:  # a Feeder of its own (RemoteEagle in another process, Medusa/MTP/DSpark heads)
            d.connect(session.endpoint)
        getter = getattr(feeder.drafter if isinstance(feeder, EagleFeeder) else feeder, "draft_to_target_ids", None)
        slots.append(Slot(d, feeder, own, getter() if getter is not None else None,
                          getattr(d, "name", "eagle3" if isinstance(d, Eagle3Drafter) else type(d).__name__)))
    if session is not None:
        session.wait_for_subscribers(sum(1 for s in slots if s.sites))
    return session, slots
