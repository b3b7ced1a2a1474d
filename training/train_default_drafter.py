"""Retrain the EAGLE-3 drafter shipped for the default model (probebus/models/default-drafter).

    nice -n 10 python training/train_default_drafter.py            # record + train + evaluate (~45 min on 2 idle cores)
    nice -n 10 python training/train_default_drafter.py --compare /tmp/old-drafter   # also score a previous head

Run it after every retrain of the default model: a drafter is trained on its target's features.
It overwrites only the drafter's own files in the output folder (config.json,
model.safetensors, eval.json, README.md); other files there are left alone.

1. Record the target's own greedy continuations of training-split prompts (every `def` context,
   16 a file, and every file window: each file's top and 3 random lines, 48-256 tokens; with
   --sampled-prompts N also N continuations sampled at --temperature) with probes on the three
   feature sites (and with --soft the target's final norm), the same path as `probebus record`
   (probe.attach + exporters.ArrowRecorder), into a temporary folder (not committed).
2. Train with `decoder.train_drafter` (what `probebus train-drafter` runs): on the recorded
   continuation tokens (the prompts are context, not labels: `TrainConfig.label_prompts`), or with
   --soft against the target's whole next-token distribution; 5 unrolled steps, one per draft of k = 5.
3. Measure tau (fixed k = 5, so the figure does not depend on the scheduler's timing) and tokens per
   forward on held-out prompts, greedy and sampled (and, with --compare, the same for another drafter
   folder on the same target); write eval.json and the model card.

The shipped head is the default. A head trained on the recorded tokens with the prompts' own next
tokens as labels too (`--prompt-labels`, the recipe before 2026-12-07) drafted far less on the
benchmark's held-out sets; one trained with `--soft --sampled-prompts 1800` drafted more at T = 0.8
and much less at greedy (docs/benchmarks.md, "A drafter trained on the target's distribution").
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
from decoder import SpeculativeDecoder, TrainConfig, load_drafter, train_drafter
from decoder.drafters import Eagle3Config
from probebus._code_prompts import code_prompts, file_window_prompts
from probebus._load import load_model
from probebus.models import DEFAULT_MODEL_DIR

OUT = Path(__file__).resolve().parents[1] / "probebus" / "models" / "default-drafter"


def record(model, tok, prompts: list[str], folder: Path, new_tokens: int, batch: int, soft: bool,
           sampled: list[str], temperature: float) -> dict:
    sites = [f"layers.{i}.resid_pre" for i in Eagle3Config.for_target(model.config).aux_layer_ids]
    sites += ["final_norm"] if soft else []
    torch.manual_seed(0)
    with probe.attach(model, sites) as session, exporters.ArrowRecorder(session, folder) as rec:
        sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        for kind, group, how in (("greedy", prompts, dict(do_sample=False)), (f"T={temperature}", sampled, sample)):
            for i in range(0, len(group), batch):
                enc = tok(group[i: i + batch], return_tensors="pt", padding=True)
                with torch.no_grad():
                    model.generate(**enc, max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id, **how)
                print(f"recorded {min(i + batch, len(group))}/{len(group)} prompts ({kind})", flush=True)
    return {"rows": rec.summary.rows if rec.summary else None, "sites": sites, "prompts": len(prompts),
            "sampled_prompts": len(sampled), "temperature": temperature, "new_tokens": new_tokens}


def evaluate(model, tok, drafter, prompts: list[str], new_tokens: int, k: int,
             temperature: float = 0.0) -> dict:
    taus, fwd, emitted = [], 0, 0
    with SpeculativeDecoder(model, drafter, k=k, schedule="fixed") as spec:
        for i, p in enumerate(prompts):
            enc = tok([p], return_tensors="pt")
            out = spec.generate(enc.input_ids, enc.attention_mask, max_new_tokens=new_tokens,
                                temperature=temperature, seed=i if temperature > 0 else None)
            taus.append((out.stats.tau, out.stats.row_rounds))
            fwd += out.stats.target_forwards
            emitted += out.stats.emitted
    tau = sum(t * r for t, r in taus) / sum(r for _, r in taus)
    return {"tau": round(tau, 3), "tokens_per_forward": round(emitted / fwd, 3), "prompts": len(prompts),
            "new_tokens": new_tokens, "k": k, "temperature": temperature}


def evaluate_both(model, tok, drafter, temperature: float) -> dict:
    prompts = code_prompts("heldout", 16)
    return {"greedy": evaluate(model, tok, drafter, prompts, 64, 5),
            "sampled": evaluate(model, tok, drafter, prompts, 64, 5, temperature)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=5134, help="`def` contexts (default: all of them)")
    ap.add_argument("--per-file", type=int, default=16, help="`def` contexts taken per training file")
    ap.add_argument("--window-prompts", type=int, default=1957,
                    help="also this many prompts of whole lines from training files: each file's top, and "
                    "--windows-per-file - 1 more from random lines (default: %(default)s, all of them)")
    ap.add_argument("--windows-per-file", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--window", type=int, default=96)
    ap.add_argument("--ttt-steps", type=int, default=5, help="unrolled training-time-test steps (k = 5 drafts)")
    ap.add_argument("--prompt-labels", dest="label_prompts", action="store_true",
                    help="also train on the prompts' own next tokens (real text, not what the target would "
                    "say); off by default: the head trained so drafted far less on held-out sets (README)")
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--sampled-prompts", type=int, default=0,
                    help="training-split prompts also recorded with sampled continuations (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.8, help="for the sampled continuations and evaluation")
    ap.add_argument("--soft", action="store_true", help="train against the target's whole distribution (records "
                    "final_norm too), not the recorded tokens: better sampled acceptance, worse greedy (README)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--recording", type=Path, default=None, help="reuse an existing recording")
    ap.add_argument("--compare", type=Path, default=None, help="also evaluate this drafter folder (e.g. the old one)")
    ap.add_argument("--card-only", action="store_true", help="only rewrite README.md from <out>/eval.json")
    args = ap.parse_args()
    if args.card_only:
        write_card(args.out, json.loads((args.out / "eval.json").read_text()))
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_model(str(DEFAULT_MODEL_DIR))
    for prm in model.parameters():
        prm.requires_grad_(False)
    t0 = time.time()
    folder = args.recording or Path(tempfile.mkdtemp(prefix="probebus-drafter-rec-"))
    if args.recording:
        rec: dict = {"reused": str(folder)}
    else:
        prompts = code_prompts("train", args.prompts, per_file=args.per_file)
        if args.window_prompts:
            prompts += file_window_prompts("train", args.window_prompts, tok, per_file=args.windows_per_file)
        rec = record(model, tok, prompts, folder, args.new_tokens, 16, args.soft,
                     code_prompts("train", args.sampled_prompts, seed=2), args.temperature)
        rec |= {"def_prompts": args.prompts, "per_file": args.per_file, "window_prompts": len(prompts) - args.prompts,
                "windows_per_file": args.windows_per_file}
    t_rec = time.time() - t0
    cfg = TrainConfig(steps=args.steps, batch=args.batch, draft_vocab=args.draft_vocab, window=args.window,
                      soft=args.soft, ttt_steps=args.ttt_steps, label_prompts=args.label_prompts)
    metrics = train_drafter(model, folder, args.out, cfg, resume=False, target_name="default")
    (args.out / "train_state.pt").unlink(missing_ok=True)  # resumability is for interrupted runs, not shipping
    drafter = load_drafter(args.out, model)
    ev = evaluate_both(model, tok, drafter, args.temperature)
    card = {"recording": rec, "record_seconds": round(t_rec), "train": {k: metrics[k] for k in
            ("sequences", "heldout_sequences", "tokens", "step", "loss", "acc", "seconds", "heldout")
            if k in metrics}, "train_config": cfg.__dict__,
            "heldout_eval": ev}
    if args.compare:
        try:
            card["compare"] = {"path": str(args.compare), "heldout_eval": evaluate_both(
                model, tok, load_drafter(args.compare, model), args.temperature)}
        except Exception as exc:  # noqa: BLE001 - a comparison must not lose the trained drafter
            card["compare"] = {"path": str(args.compare), "error": f"{type(exc).__name__}: {exc}"}
    card["target"] = target_summary()
    card["wall_seconds"] = round(time.time() - t0)
    defaults = vars(ap.parse_args([]))
    card["non_default_args"] = {k: str(v) for k, v in vars(args).items()
                                if v != defaults[k] and k not in ("out", "compare", "recording", "card_only")}
    (args.out / "eval.json").write_text(json.dumps(card, indent=2) + "\n")
    write_card(args.out, card)
    print(json.dumps(card, indent=2))


def target_summary() -> dict:
    """The target's recorded quality (its eval.json), so the card says what the drafter was trained for."""
    ev = json.loads((DEFAULT_MODEL_DIR / "eval.json").read_text())
    return {k: ev.get(k) for k in ("heldout_loss", "heldout_perplexity", "degeneracy", "degeneracy_reference")}


def write_card(out: Path, card: dict) -> None:
    """README.md of the drafter folder, from the numbers in eval.json."""
    cfg = json.loads((out / "config.json").read_text())
    layer = cfg["transformer_layer_config"]
    tr, tc, tgt = card["train"], card["train_config"], card["target"]
    ev = card["heldout_eval"].get("greedy", card["heldout_eval"])  # eval.json before sampled evaluation: greedy only
    sev = card["heldout_eval"].get("sampled")
    rec = card["recording"]
    comp = card.get("compare", {}).get("heldout_eval")
    comp_line = ""
    if comp and "greedy" in comp:
        comp_line = (f"\n   For comparison, the drafter shipped before this one (`--compare`) on this target and "
                     f"the\n   same prompts: tau = {comp['greedy']['tau']:.2f} greedy, {comp['sampled']['tau']:.2f} at "
                     f"T = {comp['sampled']['temperature']:g}.")
    elif comp:  # eval.json before sampled evaluation
        comp_line = (f"\n   For comparison, the drafter shipped before this one (trained for the previous target; "
                     f"`--compare`) on this target and the same prompts: tau = {comp['tau']:.2f}, "
                     f"{comp['tokens_per_forward']:.2f} tokens per target forward.")
    objective = ("the target's whole next-token distribution p over the draft vocabulary\n   (soft targets, "
                 "EAGLE's objective, from its final norm recorded alongside)") if tc.get("soft") \
        else "the recorded tokens" if tc.get("label_prompts", True) \
        else "the recorded continuation tokens (the prompts are context, not labels)"
    sampled = (f",\n   and {rec['sampled_prompts']} more sampled at T = {rec['temperature']:g}"
               if rec.get("sampled_prompts") else "")
    mix = (f" ({rec['def_prompts']:,} `def` contexts, {rec.get('per_file', 16)} a file at most, and\n   "
           f"{rec['window_prompts']:,} file windows of 48-256 tokens: each file's top and "
           f"{rec.get('windows_per_file', 4) - 1} from random lines)" if rec.get("window_prompts") else "")
    n_prompts = f"{rec['prompts']:,}" if "prompts" in rec else "?"  # a reused recording's card does not know it
    sampled_line = f"; sampled at T = {sev['temperature']:g}: tau = {sev['tau']:.2f}" if sev else ""
    loss_note = " (the cross-entropy to p: p's own entropy included)" if tc.get("soft") else ""
    acc_note = (" against the recorded tokens, the sampled ones included" if rec.get("sampled_prompts") else "")
    hold = tr.get("heldout")
    where = "" if tc.get("label_prompts", True) else " (chains over the continuations)"
    hold_line = (f"\n   On the {hold['sequences']} recorded sequences `train_drafter` holds out (training-split "
                 f"prompts),\n   drafts equal to the target's greedy token{where}: acceptance by draft position "
                 f"{' / '.join(f'{a:.2f}' for a in hold['acceptance'])}, "
                 f"tau {hold['tau']:.2f}." if hold else "")
    command = "nice -n 10 python training/train_default_drafter.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in card.get("non_default_args", {}).items())
    acc = " / ".join(f"{a:.2f}" for a in tr["acc"])
    text = f"""# default-drafter: the EAGLE-3 head shipped for the default model

An EAGLE-3 drafter (one decoder layer, hidden {layer["hidden_size"]}, {layer["num_attention_heads"]} heads /
{layer["num_key_value_heads"]} KV head, MLP {layer["intermediate_size"]}) for `probebus/models/default`, stored in
the vllm-project/speculators layout (`config.json` with `speculators_model_type: "eagle3"`,
`model.safetensors` with `fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d`; the target's
embedding is shared, not stored). Feature layers: `resid_pre` of layers
{", ".join(str(i) for i in cfg["eagle_aux_hidden_state_layer_ids"])}. Draft vocabulary: the
{cfg["draft_vocab_size"]:,} most frequent tokens of the recording (`d2t` offsets into the
{layer["vocab_size"]:,}-token target vocabulary).

Load it with `decoder.load_drafter("probebus/models/default-drafter", target=model)`,
or `--drafter default` on the command line.

## How it was made (reproducible)

    {command}

Target: the default model as shipped with this drafter (held-out loss {tgt["heldout_loss"]:.4f},
greedy degeneracy {tgt["degeneracy"]:.3f} against {tgt["degeneracy_reference"]:.3f} for real text;
see `../default/README.md`). Retrain this drafter whenever the target changes.

1. Recording: {n_prompts} training-split prompts{mix} (stdlib files never held out, see
   `../default/splits.json`), the target's own greedy continuations of {rec.get("new_tokens", "?")} tokens{sampled},
   features recorded by `probe.attach` + `exporters.ArrowRecorder` (the path
   `probebus record` uses): {rec.get("rows") or 0:,} rows, {tr["tokens"]:,} tokens, {card["record_seconds"]} s.
2. Training (`decoder.train_drafter`, what `probebus train-drafter` runs) against
   {objective}: {tc["steps"]:,} steps, batch {tc["batch"]} windows of {tc["window"]} tokens,
   AdamW lr {tc["lr"]:g} ({tc["warmup"]} warm-up steps, cosine), training-time test with
   {tc["ttt_steps"]} unrolled steps weighted {tc["decay"]}^j, seed
   {tc["seed"]}: {tr["seconds"]:.0f} s on the 2-core machine (shared with other work). Final loss
   {tr["loss"]:.2f}{loss_note}; top-1 accuracy per unrolled step {acc}{acc_note}.
3. Held-out evaluation ({ev["prompts"]} held-out prompts, {ev["new_tokens"]} new tokens, k = {ev["k"]},
   greedy): tau = {ev["tau"]:.2f} tokens per verification round, {ev["tokens_per_forward"]:.2f} tokens
   per target forward{sampled_line} (`eval.json`).{comp_line}{hold_line}

Whole script: {card["wall_seconds"] / 60:.0f} min wall time.

Caveat: the default target is tiny (held-out perplexity {tgt["heldout_perplexity"]:.0f} on the test
subset) and its greedy continuations still repeat themselves more than real code does,
which makes them easier to draft. Do not read these acceptance numbers as what EAGLE-3
reaches on a strong model.
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    main()
