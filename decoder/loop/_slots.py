"""The model drafters of one decoder: one slot each (feeder, sites, vocabulary map), one probe session for all.

    session, slots = open_slots(target, [eagle, MTPFeeder(head)], endpoint=None)
    slots[i].feeder.draft(...)          # the loop consults one slot per round (`SpeculativeDecoder._pick`)

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

from ..drafters._eagle import Eagle3Drafter
from ..drafters._feeder import EagleFeeder, feature_sites


@dataclass
class Slot:
    drafter: object  # what the caller passed (an Eagle3Drafter, a Feeder)
    feeder: object  # what the loop calls (an EagleFeeder for an Eagle3Drafter)
    sites: list[str]
    d2t: torch.Tensor | None  # target id of each draft id (sampled drafts' q is over the draft vocabulary)
    name: str


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
