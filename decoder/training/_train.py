"""Train an EAGLE-3 drafter from an Arrow recording of the target's own generations.

    probebus record --model default --prompts train.jsonl --sites 'layers.2.resid_pre,layers.4.resid_pre,...'
    probebus train-drafter --model default --recording rec/ --out drafter/

Each recorded sequence gives, per position t, the target features f_t (resid_pre of the
three feature layers) and tokens x_t. The drafter learns (f_t, x_{t+1}) -> x_{t+2}.
Training-time test: step j > 0 replaces f_t by the drafter's own output from step j-1
at t-1 (exactly what inference feeds back), and a query of step j attends to the real
keys up to its chain's start t-j plus the chain's own keys, one per earlier step.
Losses are weighted `decay**j`. The draft vocabulary is the most frequent recorded tokens.

With `TrainConfig(soft=True)` the recording must also hold the target's `final_norm` output, and
each position's target is the target's whole next-token distribution over the draft vocabulary
(its LM head applied to that output, softmax over the draft ids) instead of the one recorded
token: EAGLE's own training objective. A drafter that matches p, not only p's argmax, has more of
its sampled drafts accepted at T > 0 (acceptance is the overlap sum min(p, q)); and a recording of
sampled continuations then teaches it on the contexts sampling produces.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..drafters import Eagle3Config, Eagle3Drafter, save_drafter


@dataclass
class TrainConfig:
    steps: int = 1500
    lr: float = 2e-3
    warmup: int = 50
    ttt_steps: int = 3
    decay: float = 0.8
    window: int = 128
    batch: int = 8
    draft_vocab: int = 2048
    seed: int = 0
    save_every: int = 250
    holdout: float = 0.05  # share of recorded sequences kept out of training for held-out acceptance
    eval_k: int = 5
    soft: bool = False  # targets: the target's distribution (needs `final_norm` recorded), not the recorded token
    # Also train on the prompts' own next tokens (real text, not what the target would say). Off: only the target's
    # recorded continuations are labels, the prompts stay context; the shipped head trained so drafted 1.8-2.0x as
    # many tokens a round on the benchmark's held-out sets as one trained with them (docs/design.md). Soft targets
    # keep their loss at every position drawn (there p is the target's own, a right label in the prompt too).
    label_prompts: bool = False


def load_sequences(recording: str | Path, aux_layer_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(tokens [T], features [T, 3H])] per recorded (run, seq_id), ordered by position: EAGLE-3's inputs."""
    return load_site_sequences(recording, [f"layers.{i}.resid_pre" for i in aux_layer_ids])


def load_site_sequences(recording: str | Path, sites: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(tokens [T], features [T, len(sites) * H])] per recorded (run, seq_id), ordered by position; the sites'
    features concatenated in the order given. Sequences with a gap (dropped captures) are skipped."""
    return [(t, f) for t, f, _ in _sequences(recording, sites)]


def _sequences(recording: str | Path, sites: list[str]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """`load_site_sequences` with each sequence's prompt length (its rows captured in prefill)."""
    from exporters import activations  # decoder -> exporters: the reader is the exporters' job

    parts = [activations(recording, site=s) for s in sites]
    first = parts[0]
    if len(first) == 0:
        raise ValueError(f"{recording} has no rows for {sites[0]}; record the feature sites {sites}")
    keys = []
    for a in parts:
        runs = np.unique(np.array(a.run), return_inverse=True)[1]
        key = np.lexsort((a.position.numpy(), a.seq_id.numpy(), runs))
        keys.append(key)
        if len(a) != len(first):
            raise ValueError(f"feature sites have different row counts ({len(a)} vs {len(first)}): "
                             "incomplete recording")
    order = keys[0]
    run_codes = np.unique(np.array(first.run), return_inverse=True)[1][order]
    seq = first.seq_id.numpy()[order]
    pos = first.position.numpy()[order]
    tok = first.token_id.numpy()[order]
    prefill = np.asarray(first.phase)[order] == "prefill"
    feats = torch.cat([a.tensor[torch.from_numpy(k)].float() for a, k in zip(parts, keys, strict=True)], -1)
    for a, k in zip(parts[1:], keys[1:], strict=True):
        if not np.array_equal(a.position.numpy()[k], pos) or not np.array_equal(a.seq_id.numpy()[k], seq):
            raise ValueError("feature sites disagree on (seq_id, position): incomplete recording")
    out = []
    bounds = np.flatnonzero((np.diff(seq) != 0) | (np.diff(run_codes) != 0)) + 1
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(seq)], strict=True):
        if not np.array_equal(pos[lo:hi], np.arange(hi - lo)):
            continue  # a sequence with a gap (dropped captures) cannot be trained on safely
        out.append((torch.from_numpy(tok[lo:hi].copy()), feats[lo:hi], int(prefill[lo:hi].sum())))
    return out


def draft_vocabulary(seqs: list[tuple[torch.Tensor, torch.Tensor]], vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent target ids, sorted (draft id i <-> target id ids[i])."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for toks, _ in seqs:
        counts += torch.bincount(toks, minlength=vocab)
    size = min(size, vocab)
    return torch.topk(counts, size).indices.sort().values


def ttt_mask(length: int, step: int) -> torch.Tensor:
    """[L, (step+1)L]: real keys up to the chain start, then one key per earlier chain step."""
    t = torch.arange(length)
    blocks = [t[None, :] <= (t[:, None] - step)]
    for i in range(1, step + 1):
        blocks.append(t[None, :] == (t[:, None] - step + i))
    return torch.cat(blocks, 1)


def ttt_chain(drafter: Eagle3Drafter, embed: nn.Embedding, toks: torch.Tensor, feats: torch.Tensor,
              steps: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yield (j, h, normed h, logits) for unrolled steps j = 0..steps-1 over toks [B, L+2], feats [B, L, 3H].

    Step j at position t continues the chain that started at t - j, fed its own previous
    output: exactly what inference sees after j accepted drafts.
    """
    b, length = feats.shape[:2]
    layer = drafter.midlayer
    with torch.no_grad():
        emb = embed(toks[:, 1: length + 1])
    pos = torch.arange(length, device=feats.device).expand(b, length)
    hidden = drafter.fuse(feats)
    emb = emb.to(hidden.dtype)
    ks, vs = [], []
    for j in range(steps):
        q, k, v, res = layer.project(emb, hidden, pos)
        ks.append(k)
        vs.append(v)
        h = layer.attend(q, torch.cat(ks, 2), torch.cat(vs, 2), ttt_mask(length, j).to(feats.device)[None], res)
        hn = drafter.norm(h)
        yield j, h, hn, drafter.lm_head(hn)
        hidden = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)  # feature at t = own output at t-1


def ttt_loss(drafter: Eagle3Drafter, embed: nn.Embedding, toks: torch.Tensor, feats: torch.Tensor,
             targets: torch.Tensor, cfg: TrainConfig,
             soft: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float]]:
    """toks [B, L+2], feats [B, L, 3H], targets [B, L] draft ids (-100 = not in the draft vocab); soft [B, L, V_draft]
    the target's distribution over the draft vocabulary at each position (`TrainConfig.soft`), the loss's target
    where given (accuracy stays against `targets`)."""
    accs = []
    total = feats.new_zeros(())
    for j, _, _, logits in ttt_chain(drafter, embed, toks, feats, cfg.ttt_steps):
        tgt = targets.clone()
        tgt[:, :j] = -100  # no chain can start before position 0
        if soft is not None:  # cross-entropy against p: the KL to p, up to p's own entropy
            ce = -(soft[:, j:] * F.log_softmax(logits[:, j:].float(), -1)).sum(-1).mean()
        else:
            ce = F.cross_entropy(logits.transpose(1, 2), tgt, ignore_index=-100)
        total = total + cfg.decay ** j * ce
        ok = tgt != -100
        accs.append(float((logits.argmax(-1)[ok] == tgt[ok]).float().mean()) if ok.any() else 0.0)
    return total, accs


def windows(n: int, window: int) -> Iterator[tuple[int, int]]:
    """(start, length) of the chain windows over a sequence of n tokens: each window needs the two
    tokens after it (the next input and the target), and a window shorter than 2 is not worth a chain."""
    for s in range(0, n - 2, window):
        length = min(window, n - 2 - s)
        if length < 2:
            return
        yield s, length


@torch.no_grad()
def holdout_count(n: int, share: float) -> int:
    """Sequences held out of n for the acceptance report: `share` of them, at least one where share > 0 (a small
    recording of 4 prompts at 5 % holds out one, not none), and never the last one training has."""
    if share <= 0 or n < 2:
        return 0
    return min(n - 1, max(1, int(n * share)))


def heldout_acceptance(drafter: Eagle3Drafter, embed: nn.Embedding, seqs: list[tuple[torch.Tensor, torch.Tensor]],
                       k: int = 5, window: int = 128, head: nn.Module | None = None,
                       first: list[int] | None = None) -> dict:
    """Acceptance by draft position on held-out sequences: the share of chains whose first i+1 drafts all
    equal the target's greedy token. That is the recorded token where the recording is the target's greedy
    output; where the features also carry the target's `final_norm` (a soft-target recording, sampled
    continuations included), it is the argmax of `head` over it. `first`: per sequence, the first chain start
    counted (chains before it would be scored on prompt tokens)."""
    d2t = drafter.draft_to_target_ids()
    hits = torch.zeros(k, device=d2t.device)
    chains = 0
    dev = d2t.device
    width = len(drafter.config.aux_layer_ids) * drafter.config.target_hidden_size if head is not None else 0
    for n, (toks, feats) in enumerate(seqs):
        toks, feats = toks.to(dev), feats.to(dev)
        start = first[n] if first else 0
        labels = toks
        if head is not None and feats.shape[-1] > width:  # the target's final norm: its greedy tokens
            labels = torch.cat([toks[:1], head(feats[:, width:]).argmax(-1)])  # labels[t + 1] = argmax at t
            feats = feats[:, :width]
        for s, length in windows(len(toks), window):
            t_win = toks[s: s + length + 2][None]
            l_win = labels[s: s + length + 2]
            alive = torch.arange(s, s + length, device=dev) >= start
            chains += int(alive.sum())
            for j, _, _, logits in ttt_chain(drafter, embed, t_win, feats[s: s + length][None], k):
                if j >= length:
                    break
                pos = torch.arange(j, length, device=dev)
                hit = d2t[logits[0, pos].argmax(-1)] == l_win[pos + 2]
                nxt = torch.zeros_like(alive)
                nxt[pos - j] = alive[pos - j] & hit
                alive = nxt
                hits[j] += alive.sum()
    acc = (hits / max(chains, 1)).tolist()
    return {"sequences": len(seqs), "chains": chains, "acceptance": [round(a, 4) for a in acc],
            "tau": round(1 + sum(acc), 3)}


def train_drafter(target: nn.Module, recording: str | Path, out: str | Path, cfg: TrainConfig | None = None, *,
                  aux_layer_ids: list[int] | None = None, resume: bool = True, progress: bool = True,
                  target_name: str = "") -> dict:
    """Train and save (speculators layout) a drafter for `target`; returns final metrics."""
    cfg = cfg or TrainConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    dcfg = Eagle3Config.for_target(target.config, aux_layer_ids=aux_layer_ids)
    sites = [f"layers.{i}.resid_pre" for i in dcfg.aux_layer_ids] + (["final_norm"] if cfg.soft else [])
    # (tokens, features, first labelled position): position t's label is token t + 2 (`ttt_chain`), so without
    # label_prompts the first is two before the prompt's end and every label is a continuation token.
    seqs = [(t, f, 0 if cfg.label_prompts else max(0, n - 2)) for t, f, n in _sequences(recording, sites)]
    seqs = [s for s in seqs if len(s[0]) >= 8 and len(s[0]) - s[2] >= 4]
    if not seqs:
        raise ValueError(f"{recording}: no complete sequence of at least 8 tokens")
    # a fixed, seeded choice of held-out sequences (the same on resume)
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    n_hold = holdout_count(len(seqs), cfg.holdout)
    heldout = [seqs[i] for i in order[:n_hold]]
    seqs = [seqs[i] for i in sorted(order[n_hold:])]
    ids = draft_vocabulary([(t, f) for t, f, _ in seqs], dcfg.vocab_size, cfg.draft_vocab)
    dcfg.draft_vocab_size = len(ids)
    drafter = Eagle3Drafter(dcfg)
    drafter.d2t.copy_(ids - torch.arange(len(ids)))
    drafter.t2d.zero_()
    drafter.t2d[ids] = True
    to_draft = torch.full((dcfg.vocab_size,), -100, dtype=torch.long)
    to_draft[ids] = torch.arange(len(ids))
    dev = next(target.parameters()).device  # train where the target lives (its embedding is an input)
    drafter.to(dev)
    to_draft = to_draft.to(dev)
    embed = target.get_input_embeddings()
    width = len(dcfg.aux_layer_ids) * dcfg.target_hidden_size
    head = _draft_head(target, ids.to(dev)) if cfg.soft else None
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=0.0)
    state_file = out / "train_state.pt"
    start = 0
    if resume and state_file.is_file():
        state = torch.load(state_file, weights_only=True)
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    pool = [s for s in seqs if len(s[0]) >= cfg.window + 2]
    window = cfg.window
    if not pool:  # every sequence is short: train on windows as long as the shortest allows
        pool, window = seqs, min(len(s[0]) for s in seqs) - 2
    gen = torch.Generator().manual_seed(cfg.seed + start)
    metrics: dict = {"sequences": len(seqs), "heldout_sequences": len(heldout),
                     "tokens": int(sum(len(s[0]) for s in seqs)), "window": window, "resumed_from": start}
    t0 = time.perf_counter()
    bar = _Bar(cfg.steps, start) if progress else None
    for step in range(start, cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        toks, feats, unlabelled = _batch(pool, cfg.batch, window, gen)
        toks, feats = toks.to(dev), feats.to(dev)
        targets = to_draft[toks[:, 2: window + 2]].masked_fill(unlabelled.to(dev), -100)
        soft = None
        if head is not None:  # position t's target: the target's distribution after t + 1 (its final norm there)
            with torch.no_grad():
                soft = F.softmax(head(feats[:, 1:, width:]).float(), -1)
        loss, accs = ttt_loss(drafter, embed, toks, feats[:, :window, :width], targets, cfg, soft)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        metrics.update(step=step + 1, loss=float(loss.detach()), acc=accs)
        if bar:
            bar.update(step + 1, metrics["loss"], accs)
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step + 1,
                        "config": asdict(cfg)}, state_file)
    if bar:
        bar.close()
    metrics["seconds"] = time.perf_counter() - t0
    drafter.eval()
    if heldout:
        drafter.bind_target(target)
        metrics["heldout"] = heldout_acceptance(drafter, embed, [(t, f) for t, f, _ in heldout], cfg.eval_k,
                                                window, head=target.get_output_embeddings(),
                                                first=[n for _, _, n in heldout])
    save_drafter(drafter, out, target_name=target_name)
    return metrics


def _batch(pool: list, batch: int, window: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor,
                                                                            torch.Tensor]:
    """Token windows [B, window + 2], their features [B, window + 1, ...] (the last row is read only by soft
    targets: the target's final norm one position on) and which chain positions have no label [B, window]."""
    toks, feats, unlabelled = [], [], []
    for i in torch.randint(len(pool), (batch,), generator=gen).tolist():
        t, f, first = pool[i]
        # a window that ends in the sequence's labelled part (one with no label at all would give no loss)
        lo = min(max(0, first - window + 1), len(t) - window - 2)
        s = lo + int(torch.randint(len(t) - window - 1 - lo, (1,), generator=gen))
        toks.append(t[s: s + window + 2])
        feats.append(f[s: s + window + 1])
        unlabelled.append(torch.arange(s, s + window) < first)
    return torch.stack(toks), torch.stack(feats), torch.stack(unlabelled)


def _draft_head(target: nn.Module, ids: torch.Tensor) -> nn.Linear:
    """The target's LM head cut to the draft vocabulary: its logits over the draft ids, whose softmax is the
    soft target (EAGLE's: the target's p renormalised over the draft vocabulary)."""
    full = target.get_output_embeddings()
    head = nn.Linear(full.in_features, len(ids), bias=full.bias is not None).to(full.weight.device)
    with torch.no_grad():
        head.weight.copy_(full.weight[ids])
        if full.bias is not None:
            head.bias.copy_(full.bias[ids])
    return head.requires_grad_(False)


class _Bar:
    """A rich progress bar with loss and per-step accuracy."""

    def __init__(self, total: int, done: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.p = Progress(TextColumn("train-drafter"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                          TextColumn("{task.fields[info]}"))
        self.task = self.p.add_task("train", total=total, completed=done, info="")
        self.p.start()

    def update(self, step: int, loss: float, accs: list[float]) -> None:
        acc = " ".join(f"{a:.2f}" for a in accs)
        self.p.update(self.task, completed=step, info=f"loss {loss:.3f} acc/step {acc}")

    def close(self) -> None:
        self.p.stop()
