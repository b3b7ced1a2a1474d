"""Retrain the heads shipped for the default model that read its `final_norm`: Medusa, MTP (attention-free and
with attention), clustered MTP, DSpark.

    nice -n 10 python training/train_default_heads.py --method medusa      # probebus/models/default-medusa
    nice -n 10 python training/train_default_heads.py --method mtp --recording /tmp/rec        # default-mtp
    nice -n 10 python training/train_default_heads.py --method clustered --recording /tmp/rec  # default-clustered
    nice -n 10 python training/train_default_heads.py --method mtp-attn --recording /tmp/rec   # default-mtp-attn

1. Record the target's own greedy continuations of training-split prompts with a probe on
   `final_norm` (probe.attach + exporters.ArrowRecorder: the path `probebus record` uses), into a
   temporary folder (not committed; pass it to the next method with --recording).
2. Train with `decoder.train_medusa` / `decoder.train_mtp` (what `probebus train-drafter --method M` runs).
3. Measure tau and tokens per forward on held-out prompts; write eval.json and README.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import exporters
import probe
from decoder import SpeculativeDecoder, load_named_drafter
from decoder.training import DSparkTrainConfig, HeadsTrainConfig, MTPTrainConfig, train_dspark, train_medusa, train_mtp
from probebus._code_prompts import code_prompts
from probebus._load import load_model
from probebus.models import DEFAULT_MODEL_DIR

MODELS = Path(__file__).resolve().parents[1] / "probebus" / "models"


def record(model, tok, prompts: list[str], folder: Path, new_tokens: int, batch: int) -> dict:
    with probe.attach(model, ["final_norm"]) as session, exporters.ArrowRecorder(session, folder) as rec:
        for i in range(0, len(prompts), batch):
            enc = tok(prompts[i: i + batch], return_tensors="pt", padding=True)
            with torch.no_grad():
                model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            print(f"recorded {min(i + batch, len(prompts))}/{len(prompts)} prompts", flush=True)
    return {"rows": rec.summary.rows if rec.summary else None, "sites": ["final_norm"], "prompts": len(prompts),
            "new_tokens": new_tokens}


def evaluate(model, tok, drafter, prompts: list[str], new_tokens: int, k: int) -> dict:
    rounds = acc = fwd = emitted = 0
    with SpeculativeDecoder(model, drafter, k=k, schedule="fixed") as spec:
        for p in prompts:
            enc = tok([p], return_tensors="pt")
            st = spec.generate(enc.input_ids, enc.attention_mask, max_new_tokens=new_tokens).stats
            rounds, acc, fwd, emitted = rounds + st.row_rounds, acc + st.accepted, fwd + st.target_forwards, \
                emitted + st.emitted
    return {"tau": round((acc + rounds) / rounds, 3), "tokens_per_forward": round(emitted / fwd, 3),
            "prompts": len(prompts), "new_tokens": new_tokens, "k": k, "schedule": "fixed"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=("medusa", "mtp", "mtp-attn", "clustered", "dspark"), default="medusa")
    ap.add_argument("--prompts", type=int, default=1800)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--clusters", type=int, default=64, help="clustered: vocabulary clusters")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="default: probebus/models/default-METHOD")
    ap.add_argument("--recording", type=Path, default=None, help="reuse an existing recording")
    ap.add_argument("--card-only", action="store_true", help="only rewrite README.md from <out>/eval.json")
    args = ap.parse_args()
    args.out = args.out or MODELS / f"default-{args.method}"
    if args.card_only:
        write_card(args.out, json.loads((args.out / "eval.json").read_text()))
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_model(str(DEFAULT_MODEL_DIR))
    for prm in model.parameters():
        prm.requires_grad_(False)
    t0 = time.time()
    folder = args.recording or Path(tempfile.mkdtemp(prefix="probebus-medusa-rec-"))
    rec = {"reused": str(folder)} if args.recording else record(model, tok, code_prompts("train", args.prompts),
                                                                  folder, args.new_tokens, 16)
    t_rec = time.time() - t0
    if args.method == "medusa":
        cfg = HeadsTrainConfig(heads=args.heads, layers=args.layers, steps=args.steps)
        metrics = train_medusa(model, folder, args.out, cfg, resume=False, target_name="default")
    elif args.method == "dspark":
        cfg = DSparkTrainConfig(steps=args.steps)
        metrics = train_dspark(model, folder, args.out, cfg, resume=False)
    else:
        cfg = MTPTrainConfig(clusters=args.clusters if args.method == "clustered" else 0, steps=args.steps,
                             attention=args.method == "mtp-attn")
        metrics = train_mtp(model, folder, args.out, cfg, resume=False)
    (args.out / "train_state.pt").unlink(missing_ok=True)  # resumability is for interrupted runs, not shipping
    ev = evaluate(model, tok, load_named_drafter(str(args.out), model), code_prompts("heldout", 16), 64, 4)
    card = {"method": args.method, "recording": rec, "record_seconds": round(t_rec), "train": metrics,
            "train_config": cfg.__dict__,
            "heldout_eval": ev, "wall_seconds": round(time.time() - t0), "recording_folder": str(folder)}
    (args.out / "eval.json").write_text(json.dumps(card, indent=2) + "\n")
    write_card(args.out, card)
    print(json.dumps(card, indent=2))


DESCRIPTION = {
    "medusa": """{heads} Medusa heads ({layers} residual block each, hidden 192) on the default model's
`final_norm` output, in the public FasterDecoding/Medusa layout (`config.json` with
`medusa_num_heads`, `medusa_num_layers`; `medusa_lm_head.safetensors` with `{{i}}.{{j}}.linear.*`).
The heads share the target's own output head (`medusa_shared_lm_head: true`), so only the
residual blocks are stored. Trained with `decoder.train_medusa`.""",
    "mtp": """An MTP head (DeepSeek-V3-style multi-token prediction, attention-free block with MLP
{inter}, reused at every depth) on the default model's `final_norm` output; the target's embedding
and output head are shared, not stored. Trained with `decoder.train_mtp` ({depth} unrolled steps).""",
    "mtp-attn": """DeepSeek-V3's MTP block with attention on the default model's `final_norm` output:
eh_proj of the normed state and token embedding, then a pre-norm decoder layer (self-attention over
the block's own KV cache of every accepted position, SwiGLU MLP {inter}), one block reused at every
depth; the target's embedding and output head are shared, not stored. Trained with
`decoder.train_mtp` (`attention=True`: EAGLE-3's training-time test over {depth} unrolled steps, on
windows of the recorded sequences).""",
    "clustered": """An MTP head whose output is a two-stage clustered vocabulary: {clusters} clusters of the
target's output embeddings (cosine k-means), then the tokens of the best cluster scored with the
target's own output rows ({clusters} + about {per} rows per step instead of 8,192). Same block as
`default-mtp`; trained with `decoder.train_mtp` (cluster and within-cluster cross-entropy).""",
    "dspark": """A DSpark-style parallel drafter on the default model's `final_norm` output: {positions} draft
positions from one pass of parallel residual blocks, a rank-{rank} Markov term that feeds each position the
token drafted before it, and a confidence head whose per-position acceptance estimate the scheduler uses
to pick the verify length. Trained with `decoder.train_dspark`.""",
}


def write_card(out: Path, card: dict) -> None:
    tr, ev, tc, rec = card["train"], card["heldout_eval"], card["train_config"], card["recording"]
    method = card.get("method", "medusa")
    hold = tr.get("heldout") or {"acceptance": [], "tau": float("nan"), "positions": 0}
    what = DESCRIPTION[method].format(heads=tc.get("heads"), layers=tc.get("layers"), inter=tc.get("intermediate"),
                                      depth=tc.get("depth"), clusters=tc.get("clusters"),
                                      positions=tc.get("positions"), rank=tc.get("rank"),
                                      per=8192 // max(tc.get("clusters") or 1, 1))
    command = f"nice -n 10 python training/train_default_heads.py --method {method}" + (
        f" --recording {rec['reused']}" if "reused" in rec else "")
    rows = f"{rec.get('rows') or 0:,} rows, " if rec.get("rows") else ""
    conf = ("\n   Confidence head: mean estimate per position " + " / ".join(f"{c:.2f}" for c in hold["confidence"])
            + " against observed conditional acceptance " + " / ".join(f"{c:.2f}" for c in hold["conditional"])
            + ".") if "confidence" in hold else ""
    held = hold.get("positions", hold.get("chains", 0))  # chains start at every held-out position
    batch = f"{tc['sequences']} windows of {tc['window']} positions" if tc.get("attention") else \
        f"{tc['batch']} positions"
    text = f"""# default-{method}: the {method} drafter shipped for the default model

{what}
Use: `probebus generate --drafter {method}`, or `decoder.load_named_drafter("{method}", target)`.

## How it was made

    {command}

1. Recording: training-split prompts, the target's greedy continuations, `final_norm` recorded
   through the bus ({rows}{card["record_seconds"]} s{"; reused from the Medusa run" if "reused" in rec else ""}).
2. Training: {tc["steps"]} steps of {batch}, AdamW lr {tc["lr"]:g}, losses weighted
   {tc["decay"]}^i: {tr["seconds"]:.0f} s. Final loss {tr["loss"]:.2f}; top-1 accuracy per depth
   {" / ".join(f"{a:.2f}" for a in tr["acc"])}.
3. Held out ({held:,} positions of recorded sequences not trained on): greedy chain acceptance
   by draft position {" / ".join(f"{a:.2f}" for a in hold["acceptance"])}, tau {hold["tau"]:.2f}.{conf}
   Loop on {ev["prompts"]} held-out prompts ({ev["new_tokens"]} new tokens, k = {ev["k"]}, fixed schedule,
   greedy): tau {ev["tau"]:.2f}, {ev["tokens_per_forward"]:.2f} tokens per target forward.

Whole script: {card["wall_seconds"] / 60:.0f} min wall time. The target is tiny and repetitive; do
not read these numbers as what the method reaches on a strong model.
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    main()
