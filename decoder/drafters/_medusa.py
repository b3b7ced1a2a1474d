"""Medusa heads: K small residual heads on the target's last hidden state, each guessing one token further.

    heads = load_medusa("probebus/models/default-medusa", target)      # or MedusaHeads(MedusaConfig(...))
    with SpeculativeDecoder(target, MedusaFeeder(heads), k=4) as spec: # reads `final_norm` off the bus
        out = spec.generate(ids, max_new_tokens=64)

The target's hidden state h_t after its final norm (site `final_norm`) gives x_{t+1} through
the target's own head; Medusa head i gives x_{t+2+i} from the same h_t: lm_head_i(h + SiLU(W h + b))
(one residual block per `medusa_num_layers`). All heads run at once, so a round's drafts cost one
small step however many are verified; chain mode proposes each head's top token (greedy) or a
draw from it (sampling, whose q the loop verifies against).

Checkpoints use the public FasterDecoding/Medusa layout: `config.json` with `medusa_num_heads`,
`medusa_num_layers`, `base_model_name_or_path`; `medusa_lm_head.safetensors` with keys
`{i}.{j}.linear.weight|bias` (block j of head i) and `{i}.{L}.weight` (head i's vocabulary
projection). A checkpoint without `{i}.{L}.weight` uses the target's own output head for every
head (`medusa_shared_lm_head: true`, what `train_medusa` writes by default: the shipped heads stay
small, and the target's head is already trained for this vocabulary).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import probe

from ..schedule import DraftPlan
from ..verify import sample
from ._feeder import Drafts, Feed, tree_positions


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    medusa_num_heads: int = 4
    medusa_num_layers: int = 1
    shared_lm_head: bool = True
    base_model_name_or_path: str = ""


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # Medusa's initialisation: each head starts as the target's own head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.config = cfg
        blocks = []
        for _ in range(cfg.medusa_num_heads):
            layers: list[nn.Module] = [ResBlock(cfg.hidden_size) for _ in range(cfg.medusa_num_layers)]
            if not cfg.shared_lm_head:
                layers.append(nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
            blocks.append(nn.Sequential(*layers))
        self.heads = nn.ModuleList(blocks)
        self.lm_head: nn.Module | None = None  # the target's head, when shared (not a parameter of ours)

    def bind_target(self, target: nn.Module) -> MedusaHeads:
        """Check the fit and, with a shared head, use the target's output projection (frozen)."""
        tc = target.config
        if (self.config.hidden_size, self.config.vocab_size) != (tc.hidden_size, tc.vocab_size):
            raise ValueError(f"Medusa heads for hidden {self.config.hidden_size} / vocabulary {self.config.vocab_size}"
                             f" do not fit a target with {tc.hidden_size} / {tc.vocab_size}")
        if self.config.shared_lm_head:
            object.__setattr__(self, "lm_head", target.get_output_embeddings())
        return self

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] (the target's normed last hidden state) -> logits [..., K, V]."""
        outs = []
        for head in self.heads:
            x = head(h)
            outs.append(self.lm_head(x.to(self.lm_head.weight.dtype)).to(x.dtype) if self.config.shared_lm_head else x)
        return torch.stack(outs, -2)


class MedusaFeeder:
    """Medusa heads as a bus subscriber: `final_norm` captures in, one draft per head out."""

    sites = ["final_norm"]
    name = "medusa"
    tree = True  # alternatives are scored per depth: tree drafts work

    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = heads.eval()
        self.sub: probe.Subscriber | None = None

    def connect(self, endpoint: str) -> None:
        self.sub = probe.Subscriber(endpoint, self.sites, live=True)  # each round needs the forward it follows

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close()
            self.sub = None

    def check_target(self, target: nn.Module) -> None:
        """The heads must fit this target; binding also gives them its shared modules (the output head)."""
        self.heads.bind_target(target)

    def draft_to_target_ids(self) -> torch.Tensor:
        return torch.arange(self.heads.config.vocab_size)

    def prepare(self, batch: int, max_len: int) -> None:
        p = next(self.heads.parameters())
        self.h = torch.zeros(batch, self.heads.config.hidden_size, dtype=p.dtype, device=p.device)
        self.seq_base: int | None = None

    def _collect(self, step: int, end: torch.Tensor, remap: tuple[int, torch.Tensor] | None = None) -> None:
        while True:
            cap = self.sub.recv(timeout=30)
            if cap is None:
                raise RuntimeError(f"no final_norm capture of forward {step} arrived from the probe bus within 30 s")
            if cap.step < step:  # a forward nobody asked for (a cost measurement, an aborted call)
                continue
            if cap.step > step:
                raise RuntimeError(f"final_norm of forward {cap.step} arrived while waiting for forward {step}")
            if self.seq_base is None:
                self.seq_base = int(cap.seq_ids.min())
            r = cap.seq_ids - self.seq_base
            pos = tree_positions(cap.positions, remap)
            keep = pos == end[r]
            self.h[r[keep].to(self.h.device)] = cap.tensor[keep].to(self.h.device, self.h.dtype)  # host -> device
            return

    def absorb(self, feeds: list[Feed], toks: torch.Tensor | None = None) -> None:
        """Read the newest accepted position's hidden state of every row off the bus."""
        for feed in feeds:
            self._collect(feed[0], feed[2], feed[3] if len(feed) > 3 else None)

    def _begin(self, feeds: list[Feed], toks: torch.Tensor) -> tuple[float, float]:
        """(start time, bus seconds) of a draft call: the feeds' states read off the bus, and each row's newest
        committed position (its token is the next input of a sequential head) remembered."""
        if self.sub is None:
            raise RuntimeError(f"the {self.name} head is not connected to a probe session (connect(endpoint) first)")
        t0 = time.perf_counter()
        self.absorb(feeds)
        if feeds:
            self.last = [min(e + 1, toks.shape[1] - 1) for e in feeds[-1][2].tolist()]
        return t0, time.perf_counter() - t0

    @torch.no_grad()
    def draft(self, feeds: list[Feed], toks: torch.Tensor, k: int, temperature: float, seed: int | None,
              plan: DraftPlan | None = None) -> Drafts:
        t0, bus_s = self._begin(feeds, toks)
        b = toks.shape[0]
        if k == 0:
            return Drafts.empty(b, bus_s)
        s = min(k, self.heads.config.medusa_num_heads)
        logits = self.heads(self.h)[:, :s].float()  # [B, s, V]
        probs = logits.softmax(-1)
        q = None
        if temperature > 0:
            gen = torch.Generator(device=logits.device).manual_seed(seed) if seed is not None else None
            q = (logits / temperature).softmax(-1)
            tokens = sample(q, gen)
        else:
            tokens = probs.argmax(-1)
        conf = probs.gather(2, tokens[..., None]).squeeze(-1)
        return Drafts(tokens.cpu(), tokens, conf.cpu(), q, bus_s, time.perf_counter() - t0 - bus_s)


def save_medusa(heads: MedusaHeads, path: str | Path, *, base: str = "") -> Path:
    """Write the public Medusa layout (plus `medusa_shared_lm_head`, `hidden_size`, `vocab_size`)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k.removeprefix("heads."): v.detach().float().contiguous() for k, v in heads.state_dict().items()}
    save_file(state, str(folder / "medusa_lm_head.safetensors"))
    c = heads.config
    config = {"medusa_num_heads": c.medusa_num_heads, "medusa_num_layers": c.medusa_num_layers,
              "base_model_name_or_path": base or c.base_model_name_or_path, "hidden_size": c.hidden_size,
              "vocab_size": c.vocab_size, "medusa_shared_lm_head": c.shared_lm_head, "probebus_drafter": "medusa"}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def load_medusa(path: str | Path, target: nn.Module) -> MedusaHeads:
    """Read a Medusa folder (public layout; `.safetensors` only: nothing is unpickled) and bind it to `target`."""
    folder = Path(path)
    try:
        raw = json.loads((folder / "config.json").read_text())
        n, layers = int(raw["medusa_num_heads"]), int(raw.get("medusa_num_layers", 1))
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{folder}: not a Medusa folder (config.json with medusa_num_heads): {exc}") from None
    st = folder / "medusa_lm_head.safetensors"
    if not st.is_file():
        raise ValueError(f"{folder}: no medusa_lm_head.safetensors (a .pt checkpoint must be converted first: "
                         "probebus never unpickles)")
    weights = load_file(str(st))
    shared = f"0.{layers}.weight" not in weights
    tc = target.config
    cfg = MedusaConfig(hidden_size=int(raw.get("hidden_size", tc.hidden_size)),
                       vocab_size=int(raw.get("vocab_size", tc.vocab_size)), medusa_num_heads=n,
                       medusa_num_layers=layers, shared_lm_head=shared,
                       base_model_name_or_path=raw.get("base_model_name_or_path", ""))
    heads = MedusaHeads(cfg)
    try:
        heads.heads.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"{folder}: weights do not match {n} Medusa heads of {layers} block(s): {exc}") from None
    heads.source = str(folder)
    p = next(target.parameters())
    return heads.bind_target(target).to(device=p.device).eval()
