"""A small head that predicts, per draft position, whether the target will accept the draft.

    head = ConfidenceHead.load(folder, drafter)        # None if absent or trained for other weights
    conf = head(head.features(hn, logits, step))        # P(accept | earlier drafts accepted), [B]
    metrics = train_confidence(target, drafter, "rec/", "drafter-folder/")   # `_confidence_train.py`

Inputs are the drafter's normed hidden state (what its LM head reads), its own top-1 log
probability and top-1/top-2 logit margin, and the draft step. It estimates the conditional
acceptance the scheduler multiplies along a chain; `_confidence_train.py` labels and trains it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ._eagle import Eagle3Drafter

MAX_STEPS = 8
N_STATS = 2  # -log p_top1, top1 - top2 logit margin


def drafter_fingerprint(drafter: Eagle3Drafter) -> str:
    """Identifies the drafter weights a head was trained on (a head is useless for other weights)."""
    h = hashlib.sha256()
    for name in ("fc.weight", "lm_head.weight"):
        h.update(drafter.state_dict()[name].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int, width: int = 32) -> None:
        super().__init__()
        self.hidden = hidden
        self.net = nn.Sequential(nn.Linear(hidden + N_STATS + MAX_STEPS, width), nn.SiLU(), nn.Linear(width, 1))

    @staticmethod
    def features(hn: torch.Tensor, logits: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
        """[..., hidden + stats + steps] from the drafter's normed output and draft logits."""
        lg = logits.float()
        top = lg.topk(2, dim=-1).values
        stats = torch.stack([torch.logsumexp(lg, -1) - top[..., 0], top[..., 0] - top[..., 1]], -1)
        if isinstance(step, int):
            onehot = torch.zeros(*lg.shape[:-1], MAX_STEPS, device=lg.device)
            onehot[..., min(step, MAX_STEPS - 1)] = 1.0
        else:
            onehot = F.one_hot(step.clamp(max=MAX_STEPS - 1), MAX_STEPS).float()
        return torch.cat([hn.float(), stats, onehot], -1)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """Acceptance probability per row."""
        return torch.sigmoid(self.net(feats).squeeze(-1))

    @torch.no_grad()
    def score(self, hn: torch.Tensor, logits: torch.Tensor, step: int) -> torch.Tensor:
        """`self(self.features(hn, logits, step))` in fewer ops: the step's one-hot folds into a bias."""
        if getattr(self, "_split", None) is None:
            w, b = self.net[0].weight.detach(), self.net[0].bias.detach()
            cut = self.hidden + N_STATS
            object.__setattr__(self, "_split", (w[:, :cut].contiguous(), [b + w[:, cut + j] for j in range(MAX_STEPS)],
                                                self.net[2].weight.detach(), self.net[2].bias.detach()))
        w_hs, biases, w2, b2 = self._split
        lg = logits.float()
        top = lg.topk(2, dim=-1).values
        stats = torch.stack([torch.logsumexp(lg, -1) - top[..., 0], top[..., 0] - top[..., 1]], -1)
        z = F.silu(F.linear(torch.cat([hn.float(), stats], -1), w_hs, biases[min(step, MAX_STEPS - 1)]))
        return torch.sigmoid(F.linear(z, w2, b2)).squeeze(-1)

    def save(self, folder: str | Path, drafter: Eagle3Drafter, metrics: dict | None = None) -> None:
        folder = Path(folder)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(folder / "confidence.safetensors"))
        meta = {"hidden": self.hidden, "width": self.net[0].out_features, "max_steps": MAX_STEPS,
                "drafter_fingerprint": drafter_fingerprint(drafter), "metrics": metrics or {}}
        (folder / "confidence.json").write_text(json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path, drafter: Eagle3Drafter) -> ConfidenceHead | None:
        """The head saved next to a drafter, or None when absent or trained for different drafter weights."""
        folder = Path(folder)
        meta_file, weights = folder / "confidence.json", folder / "confidence.safetensors"
        if not (meta_file.is_file() and weights.is_file()):
            return None
        meta = json.loads(meta_file.read_text())
        if meta.get("drafter_fingerprint") != drafter_fingerprint(drafter) or meta.get("max_steps") != MAX_STEPS:
            import logging

            logging.getLogger("decoder").warning(
                "%s: confidence head was trained for other drafter weights; ignoring it (the scheduler falls back "
                "to the drafter's own probabilities); retrain with training/train_default_confidence.py", folder)
            return None
        head = cls(int(meta["hidden"]), int(meta["width"]))
        head.load_state_dict(load_file(str(weights)))
        return head.eval()
