"""An MTP head (DeepSeek-V3-style multi-token prediction), optionally with a two-stage clustered vocabulary.

    head = load_mtp("probebus/models/default-mtp", target)
    with SpeculativeDecoder(target, MTPFeeder(head), k=4) as spec:   # reads `final_norm` off the bus
        out = spec.generate(ids, max_new_tokens=64)

One step maps (h, next token) to (h', logits): h' = h + MLP(norm(eh_proj[hnorm(h); enorm(emb(token))]))
and logits = head(norm(h')), where `emb` and `head` are the target's own (shared, frozen). The
first step takes the target's `final_norm` state at the last accepted position t and the
committed token x_{t+1}, and predicts x_{t+2}; each further step feeds its own h' and draft back
(sequential, like DeepSeek-V3's MTP modules, with one module reused at every depth). This block is
attention-free: the target's state already carries the context, and a drafter KV cache is what
makes each step dearer on a CPU. DeepSeek-V3's block with attention is `_mtp_attn.py`
(`MTPTrainConfig(attention=True)`, `"attention": true` in config.json); `load_mtp` loads either.

Clustered vocabulary (`clusters > 0`): the output first scores C clusters of the vocabulary
(k-means of the target's output embeddings), then only the tokens of the best cluster with the
target's own output rows: C + V/C rows per step instead of V. The chosen cluster's tokens carry
the draft's probability (cluster probability x within-cluster probability), so sampling draws
from an exact q with support on that cluster and verification stays lossless.

Checkpoint: `config.json` (`probebus_drafter: "mtp"`, `num_nextn_predict_layers: 1`, sizes,
`clusters`) and `model.safetensors` with DeepSeek-V3's MTP names (`enorm`, `hnorm`, `eh_proj`,
`mlp.*`, `shared_head.norm`) plus `cluster_head.weight` and `cluster_of` when clustered.
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
from ._chain import draft_chain
from ._eagle import RMSNorm
from ._feeder import Drafts, Feed
from ._medusa import MedusaFeeder
from ._mtp_attn import MTPAttnDrafter, load_mtp_attn


@dataclass
class MTPConfig:
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    clusters: int = 0  # 0 = the flat head (all V rows)
    rms_norm_eps: float = 1e-5


class MTPHead(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.config = cfg
        self.enorm, self.hnorm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.mlp.down_proj = nn.Linear(i, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.clusters:
            self.cluster_head = nn.Linear(h, cfg.clusters, bias=False)
            self.register_buffer("cluster_of", torch.zeros(cfg.vocab_size, dtype=torch.long))
        self.embed: nn.Module | None = None
        self.head: nn.Module | None = None

    def bind_target(self, target: nn.Module) -> MTPHead:
        tc = target.config
        if (self.config.hidden_size, self.config.vocab_size) != (tc.hidden_size, tc.vocab_size):
            raise ValueError(f"the MTP head is for hidden {self.config.hidden_size} / vocabulary "
                             f"{self.config.vocab_size}, the target has {tc.hidden_size} / {tc.vocab_size}")
        object.__setattr__(self, "embed", target.get_input_embeddings())
        object.__setattr__(self, "head", target.get_output_embeddings())
        if self.config.clusters:
            self._members()
        return self

    def set_clusters(self, cluster_of: torch.Tensor) -> None:
        self.cluster_of.copy_(cluster_of)
        self._members()

    def _members(self) -> None:
        """Per cluster: its token ids, padded to the largest cluster (-1 = padding)."""
        c = self.config.clusters
        sizes = torch.bincount(self.cluster_of, minlength=c)
        members = torch.full((c, int(sizes.max())), -1, dtype=torch.long)
        order = torch.argsort(self.cluster_of, stable=True)
        starts = torch.cumsum(sizes, 0) - sizes
        for k in range(c):
            members[k, : sizes[k]] = order[starts[k]: starts[k] + sizes[k]]
        object.__setattr__(self, "members", members.to(self.cluster_of.device))

    def step(self, h: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, H], token [N] -> (h' [N, H], normed h' [N, H])."""
        e = self.embed(token).to(h.dtype)
        x = self.eh_proj(torch.cat([self.hnorm(h), self.enorm(e)], -1))
        y = self.mlp_norm(x)
        x = x + self.mlp.down_proj(nn.functional.silu(self.mlp.gate_proj(y)) * self.mlp.up_proj(y))
        return x, self.shared_head.norm(x)

    def full_logits(self, hn: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary [N, V] (the flat head)."""
        w = self.head.weight
        return (hn.to(w.dtype) @ w.T).float()

    def probs(self, hn: torch.Tensor) -> torch.Tensor:
        """The draft distribution over the whole vocabulary [N, V]: flat, or the best cluster's tokens only."""
        if not self.config.clusters:
            return self.full_logits(hn).softmax(-1)
        best = self.cluster_head(hn).argmax(-1)  # [N]: C rows scored
        ids = self.members[best]  # [N, M]
        rows = self.head.weight[ids.clamp(min=0)]  # [N, M, H]: C + V/C rows scored, not V
        lg = torch.einsum("nh,nmh->nm", hn.to(rows.dtype), rows).float().masked_fill(ids < 0, float("-inf"))
        within = lg.log_softmax(-1)  # q: the best cluster's tokens, renormalised (the cluster choice is greedy)
        out = torch.zeros(hn.shape[0], self.config.vocab_size, device=hn.device)
        out.scatter_add_(1, ids.clamp(min=0), within.exp().masked_fill(ids < 0, 0.0))  # padding adds 0 to id 0
        return out


class MTPFeeder(MedusaFeeder):
    """The MTP head as a bus subscriber: `final_norm` in, a sequential chain of drafts out."""

    name = "mtp"
    tree = False  # a chain drafter (its steps depend on the previous draft)

    @torch.no_grad()
    def draft(self, feeds: list[Feed], toks: torch.Tensor, k: int, temperature: float, seed: int | None,
              plan: DraftPlan | None = None) -> Drafts:
        t0, bus_s = self._begin(feeds, toks)
        b = toks.shape[0]
        if k == 0:
            return Drafts.empty(b, bus_s)
        head = self.heads
        dev = self.h.device
        state = {"h": None}
        h, hn = head.step(self.h, toks[torch.arange(b), torch.tensor(self.last)].to(dev))
        state["h"] = h
        gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None

        def step(tok: torch.Tensor, i: int) -> torch.Tensor:
            state["h"], hn_ = head.step(state["h"], tok)
            return head.probs(hn_).clamp_min(1e-30).log()

        tokens, conf, q = draft_chain(head.probs(hn).clamp_min(1e-30).log(), step, k, temperature, gen, plan)
        return Drafts(tokens.cpu(), tokens, conf, q, bus_s, time.perf_counter() - t0 - bus_s)


def save_mtp(head: MTPHead, path: str | Path) -> Path:
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, str(folder / "model.safetensors"))
    cfg = {"probebus_drafter": "mtp", "num_nextn_predict_layers": 1, **asdict(head.config)}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


def load_mtp(path: str | Path, target: nn.Module) -> MTPHead | MTPAttnDrafter:
    """The MTP head in `path`: attention-free (MTPHead), or with attention (`"attention": true`: MTPAttnDrafter)."""
    folder = Path(path)
    try:
        raw = json.loads((folder / "config.json").read_text())
        if raw.get("attention"):
            return load_mtp_attn(folder, raw, target)
        cfg = MTPConfig(**{k: raw[k] for k in ("hidden_size", "intermediate_size", "vocab_size")},
                        clusters=int(raw.get("clusters", 0)), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{folder}: not an MTP folder (config.json with hidden_size, intermediate_size, "
                         f"vocab_size): {exc}") from None
    head = MTPHead(cfg)
    try:
        head.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"{folder}: weights do not match the MTP head in config.json: {exc}") from None
    head.source = str(folder)
    p = next(target.parameters())
    return head.bind_target(target).to(device=p.device).eval()
