"""DSpark-style parallel drafting: P draft positions from one pass, a light Markov head, a confidence head.

    head = load_dspark("probebus/models/default-dspark", target)
    with SpeculativeDecoder(target, DSparkFeeder(head), k=4) as spec:     # reads `final_norm` off the bus
        out = spec.generate(ids, max_new_tokens=64)

From the target's `final_norm` state h_t and the committed token x_{t+1}, one pass of P parallel
residual blocks gives base states b_1..b_P for draft positions t+2..t+P+1. Adjacent drafts are
not independent: a low-rank Markov term adds M(emb(previous draft)) to b_i before the target's
own output head scores it, so position i sees the token chosen at i-1 (a matrix-vector product
per position, not another pass). A confidence head reads each position's state and its
distribution's peak and entropy and predicts the probability that the draft is accepted given
that the one before it was; the loop's scheduler calibrates that estimate online and picks the
verify length from it, as it does with EAGLE-3's confidence head.

Checkpoint: `config.json` (`probebus_drafter: "dspark"`, positions, rank, sizes) and
`model.safetensors`; the target's embedding and output head are shared, not stored.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..schedule import DraftPlan
from ..verify import sample
from ._eagle import RMSNorm
from ._feeder import Drafts, Feed
from ._medusa import MedusaFeeder, ResBlock


@dataclass
class DSparkConfig:
    hidden_size: int
    vocab_size: int
    positions: int = 4
    rank: int = 64
    rms_norm_eps: float = 1e-5


class DSparkHead(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.in_proj = nn.Linear(2 * h, h, bias=False)
        self.blocks = nn.ModuleList([ResBlock(h) for _ in range(cfg.positions)])
        self.markov_down = nn.Linear(h, cfg.rank, bias=False)
        self.markov_up = nn.Linear(cfg.rank, h, bias=False)
        nn.init.zeros_(self.markov_up.weight)  # starts as the parallel drafter; training adds the dependency
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.confidence = nn.Sequential(nn.Linear(h + 2, 32), nn.SiLU(), nn.Linear(32, 1))
        self.embed: nn.Module | None = None
        self.head: nn.Module | None = None

    def bind_target(self, target: nn.Module) -> DSparkHead:
        tc = target.config
        if (self.config.hidden_size, self.config.vocab_size) != (tc.hidden_size, tc.vocab_size):
            raise ValueError(f"the DSpark head is for hidden {self.config.hidden_size} / vocabulary "
                             f"{self.config.vocab_size}, the target has {tc.hidden_size} / {tc.vocab_size}")
        object.__setattr__(self, "embed", target.get_input_embeddings())
        object.__setattr__(self, "head", target.get_output_embeddings())
        return self

    def base(self, h: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """One pass: h [N, H] and the committed token [N] -> base states [N, P, H]."""
        u = self.in_proj(torch.cat([h, self.embed(token).to(h.dtype)], -1))
        return torch.stack([blk(u) for blk in self.blocks], 1)

    def position(self, b: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft position: base state b [N, H], previous token [N] -> (logits [N, V], raw confidence [N],
        normed state)."""
        x = self.norm(b + self.markov_up(self.markov_down(self.embed(prev).to(b.dtype))))
        w = self.head.weight
        logits = (x.to(w.dtype) @ w.T).float()
        logp = logits.log_softmax(-1)
        peak = logp.max(-1).values
        ent = -(logp.exp() * logp).sum(-1)
        conf = torch.sigmoid(self.confidence(torch.cat([x.detach(), peak[:, None].detach(),
                                                        ent[:, None].detach()], -1)).squeeze(-1))
        return logits, conf, x


class DSparkFeeder(MedusaFeeder):
    """The DSpark head as a bus subscriber: `final_norm` in, up to P drafts with per-position confidence out."""

    name = "dspark"
    tree = False

    @torch.no_grad()
    def draft(self, feeds: list[Feed], toks: torch.Tensor, k: int, temperature: float, seed: int | None,
              plan: DraftPlan | None = None) -> Drafts:
        t0, bus_s = self._begin(feeds, toks)
        b = toks.shape[0]
        if k == 0:
            return Drafts.empty(b, bus_s)
        dev = self.h.device
        prev = toks[torch.arange(b), torch.tensor(self.last)].to(dev)
        base = self.heads.base(self.h, prev)
        gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
        tokens, confs, qs = [], [], []
        for i in range(min(k, self.heads.config.positions)):
            logits, conf, _ = self.heads.position(base[:, i], prev)
            if temperature > 0:
                q = (logits / temperature).softmax(-1)
                prev = sample(q, gen)
                qs.append(q)
            else:
                prev = logits.argmax(-1)
            tokens.append(prev)
            confs.append(conf)
        tok = torch.stack(tokens, 1)
        return Drafts(tok.cpu(), tok, torch.stack(confs, 1).float().cpu(), torch.stack(qs, 1) if qs else None,
                      bus_s, time.perf_counter() - t0 - bus_s)


def save_dspark(head: DSparkHead, path: str | Path) -> Path:
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"probebus_drafter": "dspark", **asdict(head.config)}, indent=2)
                                        + "\n")
    return folder


def load_dspark(path: str | Path, target: nn.Module) -> DSparkHead:
    folder = Path(path)
    try:
        raw = json.loads((folder / "config.json").read_text())
        cfg = DSparkConfig(int(raw["hidden_size"]), int(raw["vocab_size"]), int(raw.get("positions", 4)),
                           int(raw.get("rank", 64)), float(raw.get("rms_norm_eps", 1e-5)))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{folder}: not a DSpark folder (config.json with hidden_size, vocab_size): {exc}") from None
    head = DSparkHead(cfg)
    try:
        head.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"{folder}: weights do not match the DSpark head in config.json: {exc}") from None
    head.source = str(folder)
    p = next(target.parameters())
    return head.bind_target(target).to(device=p.device).eval()
