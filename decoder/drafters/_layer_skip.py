"""Pick the layers a self-speculative (early-exit) drafter keeps, from a measurement.

    table = fit_layer_skip(target, sequences, out="default-layer-skip/")   # writes config.json
    drafter = load_layer_skip("default-layer-skip/", target)               # LayerSkipDrafter(target, layers=N)

For every candidate N (1 .. layers-1) one forward of each sequence with `output_hidden_states`
gives what an early exit after layer N would propose at every position (the target's final
norm and head on hidden state N). While a chain is accepted its drafts are the target's own
greedy tokens, so teacher forcing measures greedy chain acceptance exactly: draft j from
position t is accepted iff the exits at t..t+j all agree with the full model. The cost side is
measured on this machine: an N-layer step against a full step (both at batch 1 with a cache).
The chosen N (and k) maximise the predicted tokens per unit time,

    (1 + a_1 + ... + a_k) / ((k + 1) * c_N + (1 - N / L) * v_{k+1} / v_1)

with a_j the chain acceptance, c_N the cost of an N-layer step relative to a full one, v_L the
target's measured forward over L tokens, and L its layer count: k drafting steps, one N-layer
pass for the last draft, and a verify forward that starts at layer N (the draft's states of the
kept layers are reused, see `LayerSkipDrafter`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..schedule import CostModel
from ._draft_model import LayerSkipDrafter, early_exit_view


@torch.no_grad()
def exit_acceptance(target: nn.Module, sequences: list[torch.Tensor], k: int) -> dict[int, list[float]]:
    """N -> greedy chain acceptance by draft position 1..k of an early exit after N layers."""
    n_layers = target.config.num_hidden_layers
    norm, head = target.model.norm, target.get_output_embeddings()
    hits = {n: torch.zeros(k) for n in range(1, n_layers)}
    chains = 0
    for seq in sequences:
        out = target(seq[None], output_hidden_states=True)
        full = out.logits[0].argmax(-1)  # [T]
        t = len(seq)
        starts = t - k
        if starts <= 0:
            continue
        chains += starts
        for n in range(1, n_layers):
            agree = head(norm(out.hidden_states[n][0])).argmax(-1) == full  # [T]
            alive = torch.ones(starts, dtype=torch.bool)
            for j in range(k):
                alive &= agree[j: j + starts]
                hits[n][j] += alive.sum()
    return {n: (h / max(chains, 1)).tolist() for n, h in hits.items()}


def fit_layer_skip(target: nn.Module, sequences: list[torch.Tensor], out: str | Path | None = None, *,
                   k_max: int = 6, reps: int = 6) -> dict:
    """Measure every candidate layer count, pick the best (N, k), and write `out/config.json` if given."""
    acc = exit_acceptance(target, sequences, k_max)
    n_layers = target.config.num_hidden_layers
    full = CostModel.measure(target, 1, k_max, reps=reps)["verify"]
    table = []
    for n, a in acc.items():
        c = CostModel.measure(early_exit_view(target, n), 1, 0, reps=reps)["verify"][0] / full[0]
        for k in range(1, k_max + 1):
            tokens = 1 + sum(a[:k])
            cost = (k + 1) * c + (1 - n / n_layers) * full[k] / full[0]
            table.append({"layers": n, "k": k, "acceptance": [round(x, 4) for x in a[:k]],
                          "step_cost": round(c, 4), "predicted_speedup": round(tokens / cost, 4)})
    best = max(table, key=lambda r: r["predicted_speedup"])
    result = {"probebus_drafter": "layer-skip", "layers": best["layers"], "k": best["k"],
              "predicted_speedup": best["predicted_speedup"], "target_layers": target.config.num_hidden_layers,
              "sequences": len(sequences), "table": [r for r in table if r["k"] == best["k"]]}
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def load_layer_skip(path: str | Path, target: nn.Module) -> LayerSkipDrafter:
    """A LayerSkipDrafter with the layer count measured into `path/config.json`."""
    folder = Path(path)
    try:
        raw = json.loads((folder / "config.json").read_text())
        layers = int(raw["layers"])
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{folder}: not a layer-skip folder (config.json with 'layers'): {exc}") from None
    if raw.get("target_layers") not in (None, target.config.num_hidden_layers):
        raise ValueError(f"{folder} was measured on a {raw['target_layers']}-layer target; this one has "
                         f"{target.config.num_hidden_layers} layers: measure again (probebus train-drafter "
                         "--method layer-skip)")
    drafter = LayerSkipDrafter(target, layers)
    drafter.source = str(folder)
    return drafter
