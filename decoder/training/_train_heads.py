"""Train Medusa heads from an Arrow recording of the target's `final_norm` (its own generations).

    probebus record --model default --prompts train.jsonl --sites final_norm --out rec/
    probebus train-drafter --method medusa --model default --recording rec/ --out medusa/

Each recorded sequence gives h_t (the normed last hidden state) and tokens x_t; head i learns
h_t -> x_{t+2+i}. Losses are weighted `decay**i` (the further head matters only when every nearer
one was right). A share of the sequences is held out; acceptance by draft position there is the
share of positions whose first i+1 head guesses all equal the recorded tokens (the target's
greedy continuation, when the recording is its own greedy output). Resumable: the state is
saved to OUT/train_state.pt every `save_every` steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..drafters import MedusaConfig, MedusaHeads, save_medusa
from ._train import holdout_count, load_site_sequences

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..drafters import DSparkHead, MTPHead


@dataclass
class HeadsTrainConfig:
    heads: int = 4
    layers: int = 1
    steps: int = 1200
    lr: float = 3e-3
    warmup: int = 50
    batch: int = 512  # positions per step
    decay: float = 0.8
    seed: int = 0
    save_every: int = 200
    holdout: float = 0.05


def _targets(seqs: list[tuple[torch.Tensor, torch.Tensor]], heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All positions: (features [N, H], targets [N, heads]) with -100 past a sequence's end."""
    feats, tgts = [], []
    for toks, f in seqs:
        n = len(toks)
        t = torch.full((n, heads), -100, dtype=torch.long)
        for i in range(heads):
            if n > 2 + i:
                t[: n - 2 - i, i] = toks[2 + i:]
        feats.append(f)
        tgts.append(t)
    return torch.cat(feats), torch.cat(tgts)


@torch.no_grad()
def heads_acceptance(heads: MedusaHeads, feats: torch.Tensor, tgts: torch.Tensor) -> dict:
    """Share of positions whose first i+1 head guesses all match (chain acceptance by draft position)."""
    alive = torch.ones(len(feats), dtype=torch.bool)
    acc = []
    guesses = torch.cat([heads(feats[lo: lo + 4096]).argmax(-1) for lo in range(0, len(feats), 4096)])
    for i in range(tgts.shape[1]):
        ok = tgts[:, i] != -100
        alive &= (guesses[:, i] == tgts[:, i]) & ok
        acc.append(float(alive[ok].float().mean()) if ok.any() else 0.0)
    return {"positions": len(feats), "acceptance": [round(a, 4) for a in acc], "tau": round(1 + sum(acc), 3)}


def _prepare(recording: str | Path, out: str | Path, min_len: int, holdout: float,
             seed: int) -> tuple[Path, list, list]:
    """(output folder, created; train and held-out `final_norm` sequences of at least `min_len` tokens, the
    hold-out fixed by the seed, which also seeds the head's initialisation)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    seqs = [s for s in load_site_sequences(recording, ["final_norm"]) if len(s[0]) >= min_len]
    if not seqs:
        raise ValueError(f"{recording}: no sequence of at least {min_len} tokens with final_norm")
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_hold = holdout_count(len(seqs), holdout)
    return out, [seqs[i] for i in sorted(order[n_hold:])], [seqs[i] for i in order[:n_hold]]


def _fit(module: nn.Module, loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | list[float]]],
         items: int, cfg: HeadsTrainConfig | MTPTrainConfig | DSparkTrainConfig, out: Path, *, key: str, name: str,
         resume: bool, progress: bool, clip: float | None) -> dict:
    """The optimisation loop every head shares: AdamW, linear warm-up then cosine, `cfg.batch` random items per
    step (`loss_fn(idx) -> (loss, accuracies)`), resumable from OUT/train_state.pt (saved every `save_every`)."""
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=0.0)
    state_file = out / "train_state.pt"
    start = 0
    if resume and state_file.is_file():
        state = torch.load(state_file, weights_only=True)
        module.load_state_dict(state[key])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    gen = torch.Generator().manual_seed(cfg.seed + start)
    metrics: dict = {"resumed_from": start}
    bar = _Bar(cfg.steps, start, name) if progress else None
    t0 = time.perf_counter()
    for step in range(start, cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, accs = loss_fn(torch.randint(items, (cfg.batch,), generator=gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
        metrics.update(step=step + 1, loss=float(loss.detach()), acc=[round(float(a), 3) for a in accs])
        if bar:
            bar.update(step + 1, metrics["loss"], metrics["acc"])
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            torch.save({key: module.state_dict(), "optimizer": opt.state_dict(), "step": step + 1,
                        "config": asdict(cfg)}, state_file)
    if bar:
        bar.close()
    metrics["seconds"] = time.perf_counter() - t0
    module.eval()
    return metrics


def train_medusa(target: nn.Module, recording: str | Path, out: str | Path, cfg: HeadsTrainConfig | None = None, *,
                 resume: bool = True, progress: bool = True, target_name: str = "") -> dict:
    """Train and save (public Medusa layout, shared output head) Medusa heads for `target`; returns metrics."""
    cfg = cfg or HeadsTrainConfig()
    out, train, held = _prepare(recording, out, cfg.heads + 3, cfg.holdout, cfg.seed)
    feats, tgts = _targets(train, cfg.heads)
    tc = target.config
    heads = MedusaHeads(MedusaConfig(hidden_size=tc.hidden_size, vocab_size=tc.vocab_size,
                                     medusa_num_heads=cfg.heads, medusa_num_layers=cfg.layers,
                                     base_model_name_or_path=target_name)).bind_target(target)
    weights = torch.tensor([cfg.decay ** i for i in range(cfg.heads)])

    def loss_fn(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = heads(feats[idx].float())  # [N, K, V]
        t = tgts[idx]
        losses = torch.stack([F.cross_entropy(logits[:, i], t[:, i], ignore_index=-100) for i in range(cfg.heads)])
        with torch.no_grad():
            ok = t != -100
            acc = ((logits.argmax(-1) == t) & ok).sum(0) / ok.sum(0).clamp(min=1)
        return (weights * losses).sum(), acc

    metrics = {"sequences": len(train), "heldout_sequences": len(held), "positions": len(feats)}
    metrics.update(_fit(heads, loss_fn, len(feats), cfg, out, key="heads", name="train-medusa", resume=resume,
                        progress=progress, clip=None))
    if held:
        metrics["heldout"] = heads_acceptance(heads, *_targets(held, cfg.heads))
    save_medusa(heads, out, base=target_name)
    return metrics


class _Bar:
    """A rich progress bar with the loss and the top-1 accuracy per head (or per depth / position)."""

    def __init__(self, total: int, done: int, name: str = "train-medusa") -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.p = Progress(TextColumn(name), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                          TextColumn("{task.fields[info]}"))
        self.task = self.p.add_task("train", total=total, completed=done, info="")
        self.p.start()

    def update(self, step: int, loss: float, accs: list[float]) -> None:
        self.p.update(self.task, completed=step, info=f"loss {loss:.3f} acc {' '.join(f'{a:.2f}' for a in accs)}")

    def close(self) -> None:
        self.p.stop()


# --- MTP heads (flat or clustered vocabulary) ----------------------------------------------------------------------
@dataclass
class MTPTrainConfig:
    depth: int = 3  # unrolled steps per position (the module is reused at every depth)
    clusters: int = 0  # 0 = flat head; else C clusters of the target's output embeddings
    intermediate: int = 512
    steps: int = 1500
    lr: float = 2e-3
    warmup: int = 50
    batch: int = 256
    decay: float = 0.8
    seed: int = 0
    save_every: int = 250
    holdout: float = 0.05
    attention: bool = False  # DeepSeek-V3's block with attention (trained on sequence windows, `_mtp_attn.py`)
    window: int = 128  # attention: positions per training window
    sequences: int = 8  # attention: windows per step


def kmeans_clusters(weight: torch.Tensor, clusters: int, iters: int = 20, seed: int = 0) -> torch.Tensor:
    """Cluster id of every vocabulary row (cosine k-means of the target's output embeddings)."""
    x = torch.nn.functional.normalize(weight.detach().float(), dim=-1)
    g = torch.Generator().manual_seed(seed)
    cent = x[torch.randperm(len(x), generator=g)[:clusters]].clone()
    for _ in range(iters):
        assign = (x @ cent.T).argmax(-1)
        for c in range(clusters):
            members = x[assign == c]
            cent[c] = torch.nn.functional.normalize(members.mean(0), dim=0) if len(members) else \
                x[torch.randint(len(x), (1,), generator=g)][0]
    return (x @ cent.T).argmax(-1)


def _chains(seqs: list[tuple[torch.Tensor, torch.Tensor]], depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_t [N, H], tokens x_{t+1} .. x_{t+depth+1} [N, depth+1]) for every position with a full chain ahead."""
    feats, toks = [], []
    for t, f in seqs:
        n = len(t) - depth - 1
        if n > 0:
            feats.append(f[:n])
            toks.append(torch.stack([t[1 + j: 1 + j + n] for j in range(depth + 1)], 1))
    return torch.cat(feats), torch.cat(toks)


def _mtp_loss(head: MTPHead, h: torch.Tensor, toks: torch.Tensor, cfg: MTPTrainConfig,
              pos_in: torch.Tensor | None) -> tuple[torch.Tensor, list[float]]:
    loss, accs = h.new_zeros(()), []
    for j in range(cfg.depth):
        h, hn = head.step(h, toks[:, j])
        tgt = toks[:, j + 1]
        if cfg.clusters:
            cl = head.cluster_of[tgt]
            part = F.cross_entropy(head.cluster_head(hn).float(), cl)
            rows = head.head.weight[head.members[cl].clamp(min=0)]
            lg = torch.einsum("nh,nmh->nm", hn, rows).float().masked_fill(head.members[cl] < 0, float("-inf"))
            part = part + F.cross_entropy(lg, pos_in[tgt])
            with torch.no_grad():
                accs.append(float((head.probs(hn).argmax(-1) == tgt).float().mean()))
        else:
            lg = head.full_logits(hn)
            part = F.cross_entropy(lg, tgt)
            accs.append(float((lg.argmax(-1) == tgt).float().mean()))
        loss = loss + cfg.decay ** j * part
    return loss, accs


@torch.no_grad()
def mtp_acceptance(head: MTPHead, feats: torch.Tensor, toks: torch.Tensor) -> dict:
    """Greedy chain acceptance by draft position (teacher forcing is exact while the chain is right)."""
    alive = torch.ones(len(feats), dtype=torch.bool)
    h, acc = feats, []
    for j in range(toks.shape[1] - 1):
        h, hn = head.step(h, toks[:, j])
        alive &= head.probs(hn).argmax(-1) == toks[:, j + 1]
        acc.append(float(alive.float().mean()))
    return {"positions": len(feats), "acceptance": [round(a, 4) for a in acc], "tau": round(1 + sum(acc), 3)}


def train_mtp(target: nn.Module, recording: str | Path, out: str | Path, cfg: MTPTrainConfig | None = None, *,
              resume: bool = True, progress: bool = True) -> dict:
    """Train and save an MTP head (flat, or clustered with cfg.clusters > 0) from `final_norm` recordings."""
    from ..drafters import MTPConfig, MTPHead, save_mtp

    cfg = cfg or MTPTrainConfig()
    if cfg.attention:
        if cfg.clusters:
            raise ValueError("the MTP block with attention has the flat head only (clusters=0)")
        return _train_mtp_attn(target, recording, out, cfg, resume=resume, progress=progress)
    out, train, held = _prepare(recording, out, cfg.depth + 3, cfg.holdout, cfg.seed)
    feats, toks = _chains(train, cfg.depth)
    tc = target.config
    head = MTPHead(MTPConfig(tc.hidden_size, cfg.intermediate, tc.vocab_size, cfg.clusters,
                             float(getattr(tc, "rms_norm_eps", 1e-5))))
    pos_in = None
    if cfg.clusters:
        head.cluster_of.copy_(kmeans_clusters(target.get_output_embeddings().weight, cfg.clusters, seed=cfg.seed))
    head.bind_target(target)
    if cfg.clusters:
        pos_in = torch.zeros(tc.vocab_size, dtype=torch.long)
        for row in head.members:
            ids = row[row >= 0]
            pos_in[ids] = torch.arange(len(ids))
    metrics = {"positions": len(feats), "heldout_sequences": len(held)}
    metrics.update(_fit(head, lambda idx: _mtp_loss(head, feats[idx].float(), toks[idx], cfg, pos_in), len(feats),
                        cfg, out, key="head", name="train-mtp", resume=resume, progress=progress, clip=1.0))
    if held:
        metrics["heldout"] = mtp_acceptance(head, *_chains(held, cfg.depth))
    save_mtp(head, out)
    return metrics


def _train_mtp_attn(target: nn.Module, recording: str | Path, out: str | Path, cfg: MTPTrainConfig, *,
                    resume: bool, progress: bool) -> dict:
    """The attention block learns like EAGLE-3 (same training-time test: step j attends to the real states up to
    its chain's start and to its own earlier steps), on windows of the recorded sequences."""
    from types import SimpleNamespace

    from ..drafters import MTPAttnDrafter, save_mtp_attn
    from ._train import _batch, heldout_acceptance, ttt_loss

    out, train, held = _prepare(recording, out, 8, cfg.holdout, cfg.seed)
    window = cfg.window
    pool = [s for s in train if len(s[0]) >= window + 2]
    if not pool:  # every sequence is short: windows as long as the shortest allows
        pool, window = train, min(len(t) for t, _ in train) - 2
    drafter = MTPAttnDrafter.for_target(target.config, intermediate_size=cfg.intermediate)
    drafter.bind_target(target)  # the target's embedding and output head (frozen, not the drafter's parameters)
    embed = target.get_input_embeddings()
    ttt = SimpleNamespace(ttt_steps=cfg.depth, decay=cfg.decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    labelled = [(t, f, 0) for t, f in pool]  # every position a label, the prompts' too (as EAGLE-3 trained before)

    def loss_fn(idx: torch.Tensor) -> tuple[torch.Tensor, list[float]]:  # idx: unused, the windows come from `gen`
        toks, feats, _ = _batch(labelled, cfg.sequences, window, gen)
        return ttt_loss(drafter, embed, toks, feats[:, :window].float(), toks[:, 2: window + 2], ttt)

    metrics = {"sequences": len(pool), "window": window, "heldout_sequences": len(held)}
    metrics.update(_fit(drafter, loss_fn, 1, cfg, out, key="head", name="train-mtp", resume=resume,
                        progress=progress, clip=1.0))
    if held:
        metrics["heldout"] = heldout_acceptance(drafter, embed, held, cfg.depth, window)
    save_mtp_attn(drafter, out)
    return metrics


# --- DSpark (parallel drafts + Markov + confidence) ---------------------------------------------------------------
@dataclass
class DSparkTrainConfig:
    positions: int = 4
    rank: int = 64
    steps: int = 1500
    lr: float = 2e-3
    warmup: int = 50
    batch: int = 256
    decay: float = 0.8
    conf_weight: float = 0.2
    seed: int = 0
    save_every: int = 250
    holdout: float = 0.05


def _dspark_loss(head: DSparkHead, h: torch.Tensor, toks: torch.Tensor,
                 cfg: DSparkTrainConfig) -> tuple[torch.Tensor, list[float]]:
    base = head.base(h, toks[:, 0])
    loss, accs = h.new_zeros(()), []
    for i in range(cfg.positions):
        logits, conf, _ = head.position(base[:, i], toks[:, i])  # the previous token as accepted (teacher forcing)
        tgt = toks[:, i + 1]
        hit = (logits.argmax(-1) == tgt).float()
        loss = loss + cfg.decay ** i * F.cross_entropy(logits, tgt) + \
            cfg.conf_weight * F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), hit)
        accs.append(float(hit.mean()))
    return loss, accs


@torch.no_grad()
def dspark_acceptance(head: DSparkHead, feats: torch.Tensor, toks: torch.Tensor) -> dict:
    """Greedy chain acceptance by draft position, and the confidence head's mean estimate against it."""
    base = head.base(feats, toks[:, 0])
    alive = torch.ones(len(feats), dtype=torch.bool)
    acc, conf_mean, cond = [], [], []
    for i in range(toks.shape[1] - 1):
        logits, conf, _ = head.position(base[:, i], toks[:, i])
        hit = logits.argmax(-1) == toks[:, i + 1]
        cond.append(float(hit[alive].float().mean()) if alive.any() else 0.0)
        conf_mean.append(float(conf[alive].mean()) if alive.any() else 0.0)
        alive &= hit
        acc.append(float(alive.float().mean()))
    return {"positions": len(feats), "acceptance": [round(a, 4) for a in acc], "tau": round(1 + sum(acc), 3),
            "conditional": [round(c, 4) for c in cond], "confidence": [round(c, 4) for c in conf_mean]}


def train_dspark(target: nn.Module, recording: str | Path, out: str | Path, cfg: DSparkTrainConfig | None = None, *,
                 resume: bool = True, progress: bool = True) -> dict:
    """Train and save a DSpark head from `final_norm` recordings."""
    from ..drafters import DSparkConfig, DSparkHead, save_dspark

    cfg = cfg or DSparkTrainConfig()
    out, train, held = _prepare(recording, out, cfg.positions + 3, cfg.holdout, cfg.seed)
    feats, toks = _chains(train, cfg.positions)
    tc = target.config
    head = DSparkHead(DSparkConfig(tc.hidden_size, tc.vocab_size, cfg.positions, cfg.rank,
                                   float(getattr(tc, "rms_norm_eps", 1e-5)))).bind_target(target)
    metrics = {"positions": len(feats), "heldout_sequences": len(held)}
    metrics.update(_fit(head, lambda idx: _dspark_loss(head, feats[idx].float(), toks[idx], cfg), len(feats), cfg,
                        out, key="head", name="train-dspark", resume=resume, progress=progress, clip=1.0))
    if held:
        metrics["heldout"] = dspark_acceptance(head, *_chains(held, cfg.positions))
    save_dspark(head, out)
    return metrics
