"""Training the confidence head (`_confidence.py`) from a recording, as the drafter is trained.

    metrics = train_confidence(target, drafter, "rec/", "drafter-folder/")   # writes confidence.*

Labels: the drafter's chain is unrolled over each recorded sequence exactly as in
training-time test, and step j at position t is labelled accepted when its argmax equals
the target's greedy token there. Only chains whose earlier steps were accepted (and whose
input tokens are the target's own choices) are kept, so the head estimates the conditional
acceptance the scheduler multiplies along a chain.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..drafters import Eagle3Drafter
from ..drafters._confidence import MAX_STEPS, N_STATS, ConfidenceHead  # its input layout too
from ._train import load_sequences, ttt_chain, windows


def _greedy_tokens(target: nn.Module, toks: torch.Tensor) -> torch.Tensor:
    """g[t] = the target's greedy choice for position t+1 given toks[:t+1]."""
    dev = next(target.parameters()).device
    with torch.no_grad():
        return target(toks[None].to(dev)).logits[0].argmax(-1)


def _examples(drafter: Eagle3Drafter, embed: nn.Embedding, toks: torch.Tensor, feats: torch.Tensor,
              greedy: torch.Tensor, steps: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [N, F], labels [N]) of the on-policy chain steps of one sequence."""
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
