"""The EAGLE-3 drafter as a bus subscriber: features in, drafts out.

    feeder = EagleFeeder(drafter, session.endpoint)
    feeder.prepare(batch, max_len)
    seq_base, bus_s = feeder.feed(step, start, end, toks)   # accepted positions only
    drafts, q = feeder.draft(k, temperature, seed)

`feed` waits for the three `resid_pre` captures of forward `step`, keeps the rows of
positions start..end per row (the accepted ones), and runs the drafter over them;
`draft` then proposes k tokens by feeding the drafter's own output back. The same
object runs in the loop's process or, behind `serve_drafter`, in another one.
"""

from __future__ import annotations

import time

import torch

import probe

from ._eagle import Eagle3Drafter


class EagleFeeder:
    def __init__(self, drafter: Eagle3Drafter, endpoint: str) -> None:
        self.drafter = drafter
        self.sites = [f"layers.{i}.resid_pre" for i in drafter.config.aux_layer_ids]
        self.sub = probe.Subscriber(endpoint, self.sites)

    def close(self) -> None:
        self.sub.close()

    def prepare(self, batch: int, max_len: int) -> None:
        h = self.drafter.config.target_hidden_size
        self.feats = torch.zeros(batch, max_len, 3 * h, dtype=self.drafter.fc.weight.dtype)
        self.cache = self.drafter.new_cache(batch, max_len)
        self.seq_base: int | None = None
        self.h_last: torch.Tensor | None = None

    @torch.no_grad()
    def feed(self, step: int, start: torch.Tensor, end: torch.Tensor, toks: torch.Tensor) -> tuple[int, float]:
        t0 = time.perf_counter()
        self._collect(step, start, end)
        bus_s = time.perf_counter() - t0
        b = start.shape[0]
        span = int((end - start).max()) + 1
        pos = torch.minimum(start[:, None] + torch.arange(span), end[:, None])  # ragged rows repeat their last
        rows = torch.arange(b)[:, None]
        self.cache.truncate(start)
        d = self.drafter
        h, logits = d(d.fuse(self.feats[rows, pos]), toks[rows, pos + 1], pos, self.cache)
        pick = (end - start)[:, None, None]
        self.h_last = h.gather(1, pick.expand(b, 1, h.shape[-1]))
        self.logits_last = logits.gather(1, pick.expand(b, 1, logits.shape[-1]))
        self.fed_end = end
        return int(self.seq_base), bus_s  # type: ignore[arg-type]

    def _collect(self, step: int, start: torch.Tensor, end: torch.Tensor) -> None:
        got: set[str] = set()
        h = self.drafter.config.target_hidden_size
        slot = {s: i for i, s in enumerate(self.sites)}
        while len(got) < 3:
            cap = self.sub.recv(timeout=30)
            if cap is None:
                raise RuntimeError(f"no features for forward {step} arrived from the probe bus within 30 s")
            if cap.step != step:  # an earlier step nobody consumed (e.g. an aborted generate)
                continue
            got.add(cap.site)
            if self.seq_base is None:
                self.seq_base = int(cap.seq_ids.min())
            r = cap.seq_ids - self.seq_base
            keep = (cap.positions >= start[r]) & (cap.positions <= end[r])
            i = slot[cap.site]
            self.feats[r[keep], cap.positions[keep], i * h:(i + 1) * h] = cap.tensor[keep]

    @torch.no_grad()
    def draft(self, k: int, temperature: float, seed: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if getattr(self, "h_last", None) is None:
            raise RuntimeError("draft() before feed(): the drafter has no features of this sequence yet")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        d = self.drafter
        drafts, qs = [], []
        h, logits = self.h_last, self.logits_last
        pos = self.fed_end + 1
        for i in range(k):
            if temperature > 0:  # the sampling rule needs q over the target vocabulary
                q = (d.target_logits(logits[:, 0]) / temperature).softmax(-1)
                tok = torch.multinomial(q, 1, generator=gen).squeeze(-1)
                qs.append(q)
            else:  # argmax in the draft vocabulary, then d2t: no scatter onto the full vocabulary
                tok = d.to_target(logits[:, 0].argmax(-1))
            drafts.append(tok)
            if i + 1 < k:  # feed the drafter's own output back as the next feature
                h, logits = d(h, tok[:, None], pos[:, None] + i, self.cache)
        return torch.stack(drafts, 1), torch.stack(qs, 1) if qs else None
