"""A small head that predicts, per draft position, whether the target will accept the draft.

    head = ConfidenceHead.load(folder, drafter)        # None if absent or trained for other weights
    conf = head(head.features(hn, logits, step))        # P(accept | earlier drafts accepted), [B]
    metrics = train_confidence(target, drafter, "rec/", "drafter-folder/")   # writes confidence.*

Inputs are the drafter's normed hidden state (what its LM head reads), its own top-1 log
probability and top-1/top-2 logit margin, and the draft step. Labels come from a recording
like the drafter's training data: the drafter's chain is unrolled over each recorded
sequence exactly as in training-time test, and step j at position t is labelled accepted
when its argmax equals the target's greedy token there. Only chains whose earlier steps
were accepted (and whose input tokens are the target's own choices) are kept, so the head
estimates the conditional acceptance the scheduler multiplies along a chain.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
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


# --- training -------------------------------------------------------------------------------
def _greedy_tokens(target: nn.Module, toks: torch.Tensor) -> torch.Tensor:
    """g[t] = the target's greedy choice for position t+1 given toks[:t+1]."""
    dev = next(target.parameters()).device
    with torch.no_grad():
        return target(toks[None].to(dev)).logits[0].argmax(-1)


def _examples(drafter: Eagle3Drafter, embed: nn.Embedding, toks: torch.Tensor, feats: torch.Tensor,
              greedy: torch.Tensor, steps: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [N, F], labels [N]) of the on-policy chain steps of one sequence."""
    from ._train import ttt_chain, windows

    d2t = drafter.draft_to_target_ids()
    dev = d2t.device
    toks, feats, greedy = toks.to(dev), feats.to(dev), greedy.to(dev)
    xs, ys = [], []
    for s, length in windows(len(toks), window):
        t_win = toks[s: s + length + 2][None]
        f_win = feats[s: s + length][None]
        g = greedy[s: s + length + 2]
        ok_tok = t_win[0, 1:length + 2] == g[:length + 1]  # x_{t+1} is the target's own choice at t
        alive = ok_tok[:length].clone()  # the chain starting at c is on policy so far
        with torch.no_grad():
            for j, _, hn, logits in ttt_chain(drafter, embed, t_win, f_win, steps):
                if j >= length:
                    break
                # step j at position t (chain start t - j) predicts x_{t+2}; target's choice is g[t+1]
                pred = d2t[logits[0].argmax(-1)]
                hit = pred == g[1:length + 1]
                pos = torch.arange(j, length, device=dev)
                keep = alive[pos - j]
                if keep.any():
                    xs.append(ConfidenceHead.features(hn[0, pos[keep]], logits[0, pos[keep]], j).cpu())
                    ys.append(hit[pos[keep]].float().cpu())
                # the chain survives step j if it hit and the token it hit is the one fed next
                nxt = torch.zeros_like(alive)
                ok_next = hit[pos] & ok_tok[pos + 1]
                nxt[pos - j] = alive[pos - j] & ok_next
                alive = nxt
    if not xs:
        return torch.zeros(0, drafter.config.hidden_size + N_STATS + MAX_STEPS), torch.zeros(0)
    return torch.cat(xs), torch.cat(ys)


def _auc(score: torch.Tensor, label: torch.Tensor) -> float:
    order = score.argsort()
    ranks = torch.empty_like(score)
    ranks[order] = torch.arange(1, len(score) + 1, dtype=score.dtype)
    pos = label > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def train_confidence(target: nn.Module, drafter: Eagle3Drafter, recording: str | Path, out: str | Path, *,
                     steps: int = 6, window: int = 128, train_steps: int = 600, holdout: float = 0.1,
                     seed: int = 0, progress: bool = True) -> dict:
    """Train the confidence head for `drafter` (bound to `target`) on a recording; save it into `out`."""
    from ._train import load_sequences

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    seqs = [s for s in load_sequences(recording, drafter.config.aux_layer_ids) if len(s[0]) >= 8]
    if not seqs:
        raise ValueError(f"{recording}: no complete sequence of at least 8 tokens")
    embed = target.get_input_embeddings()
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_hold = max(1, int(len(seqs) * holdout)) if len(seqs) > 1 else 0
    parts: dict[str, list] = {"train": [], "heldout": []}
    for i, idx in enumerate(order):
        toks, feats = seqs[idx]
        x, y = _examples(drafter, embed, toks, feats, _greedy_tokens(target, toks), steps, window)
        parts["heldout" if i < n_hold else "train"].append((x, y))
        if progress and (i + 1) % 50 == 0:
            print(f"confidence: labelled {i + 1}/{len(seqs)} sequences", flush=True)
    xtr = torch.cat([x for x, _ in parts["train"]])
    ytr = torch.cat([y for _, y in parts["train"]])
    head = ConfidenceHead(drafter.config.hidden_size)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(seed)
    batch = min(4096, len(ytr))
    for it in range(train_steps):
        lr = 3e-3 * 0.5 * (1 + math.cos(math.pi * it / train_steps))
        for g in opt.param_groups:
            g["lr"] = lr
        pick = torch.randint(len(ytr), (batch,), generator=gen)
        loss = F.binary_cross_entropy_with_logits(head.net(xtr[pick]).squeeze(-1), ytr[pick])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    head.eval()
    metrics: dict = {"sequences": len(seqs), "train_examples": len(ytr), "steps": steps, "window": window,
                     "train_steps": train_steps}
    if n_hold:
        xh = torch.cat([x for x, _ in parts["heldout"]])
        yh = torch.cat([y for _, y in parts["heldout"]])
        with torch.no_grad():
            ph = head(xh)
        ptop = torch.exp(-xh[:, drafter.config.hidden_size])  # the drafter's own top-1 probability
        step = xh[:, -MAX_STEPS:].argmax(-1)
        metrics["heldout"] = {
            "examples": len(yh), "base_rate": round(float(yh.mean()), 4),
            "bce": round(float(F.binary_cross_entropy(ph.clamp(1e-6, 1 - 1e-6), yh)), 4),
            "brier": round(float(((ph - yh) ** 2).mean()), 4),
            "brier_drafter_prob": round(float(((ptop - yh) ** 2).mean()), 4),
            "auc": round(_auc(ph, yh), 4), "auc_drafter_prob": round(_auc(ptop, yh), 4),
            "by_step": [{"step": j, "n": int((step == j).sum()), "accept": round(float(yh[step == j].mean()), 3),
                         "predicted": round(float(ph[step == j].mean()), 3)}
                        for j in range(steps) if int((step == j).sum())],
        }
    metrics["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    head.save(out, drafter, metrics)
    return metrics
