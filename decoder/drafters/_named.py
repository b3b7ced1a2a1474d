"""`--drafter NAME|PATH`: every drafting method by name, or any drafter folder by what it contains.

    drafter = load_named_drafter("medusa", target)          # the heads shipped next to the target's folder
    drafter = load_named_drafter("path/to/eagle3", target)  # a folder: its config.json says which method
    SpeculativeDecoder(target, drafter, k=5)

Names (each one's files ship next to the target's own folder as `<model>-<suffix>`, like
`default-drafter` for EAGLE-3, so any model folder can ship its drafters the same way):

    default | eagle3   EAGLE-3 chain             <model>-drafter/
    eagle3-tree        EAGLE-3, tree drafts      <model>-drafter/   (the decoder's tree= option; batch 1)
    medusa             Medusa heads              <model>-medusa/
    medusa-tree        Medusa, tree drafts       <model>-medusa/
    draft-model        a separate small LM       <model>-draft-model/
    layer-skip         the target's first layers <model>-layer-skip/
    mtp                an MTP head               <model>-mtp/
    mtp-attn           DeepSeek-V3's MTP block with attention <model>-mtp-attn/
    clustered          an MTP head with a two-stage clustered vocabulary <model>-clustered/
    dspark             parallel drafts + Markov + confidence heads <model>-dspark/
    ngram              prompt lookup (no files)
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from ._checkpoint import DrafterError, load_drafter
from ._draft_model import DraftModelDrafter
from ._dspark import DSparkFeeder, load_dspark
from ._layer_skip import load_layer_skip
from ._medusa import MedusaFeeder, load_medusa
from ._mtp import MTPFeeder, load_mtp
from ._mtp_attn import MTPAttnDrafter
from ._ngram import NgramDrafter

SUFFIX = {"default": "drafter", "eagle3": "drafter", "eagle3-tree": "drafter", "medusa": "medusa",
          "medusa-tree": "medusa", "draft-model": "draft-model",
          "layer-skip": "layer-skip", "mtp": "mtp", "mtp-attn": "mtp-attn", "clustered": "clustered",
          "dspark": "dspark"}
NAMES = (*SUFFIX, "ngram")
TREE_NODES = 24  # the node budget of the -tree names (each round verifies the count that pays, up to this)


def tree_nodes(spec: str) -> int:
    """The decoder's tree= for a --drafter value: TREE_NODES for the -tree names, else 0 (chains)."""
    return TREE_NODES if spec.endswith("-tree") else 0


def shipped_folder(target: nn.Module, name: str) -> Path:
    """The folder a named drafter ships in, next to the target's folder (or inside it)."""
    suffix = SUFFIX[name]
    where = getattr(getattr(target, "config", None), "_name_or_path", "") or ""
    if where:
        model = Path(where).resolve()
        for cand in (model.parent / f"{model.name}-{suffix}", model / suffix):
            if (cand / "config.json").is_file():
                return cand
    raise DrafterError(f"no {name} drafter ships with the target {where or '(unknown folder)'}: expected "
                       f"'<model>-{suffix}/' next to its folder or '<model>/{suffix}/' inside it; train one "
                       f"(probebus train-drafter --method {'eagle3' if SUFFIX[name] == 'drafter' else name}) "
                       "or pass a folder")


def method_of(folder: Path) -> str:
    """Which drafting method a folder holds, from its config.json."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise DrafterError(f"{folder}: no readable config.json ({exc})") from None
    if not isinstance(raw, dict):
        raise DrafterError(f"{folder}/config.json: expected a JSON object")
    if "medusa_num_heads" in raw:
        return "medusa"
    if raw.get("probebus_drafter") in ("layer-skip", "mtp", "dspark"):
        return raw["probebus_drafter"]
    if raw.get("speculators_model_type") or "draft_vocab_size" in raw or "eagle_config" in raw:
        return "eagle3"
    if any(str(a).endswith("ForCausalLM") for a in raw.get("architectures") or []):
        return "draft-model"
    raise DrafterError(f"{folder}: config.json names no drafting method this loop knows (EAGLE-3, Medusa, MTP, "
                       "a causal LM, layer skip)")


def load_named_drafter(spec: str, target: nn.Module) -> object:
    """A drafter for SpeculativeDecoder from a name in NAMES or a folder."""
    if spec == "ngram":
        return NgramDrafter()
    folder = shipped_folder(target, spec) if spec in SUFFIX and not Path(spec).is_dir() else Path(spec)
    if not folder.is_dir():
        raise DrafterError(f"--drafter {spec!r}: not a name ({', '.join(NAMES)}) nor a folder")
    method = method_of(folder)
    try:
        if method == "eagle3":
            return load_drafter(folder, target)
        if method == "medusa":
            return MedusaFeeder(load_medusa(folder, target))
        if method == "layer-skip":
            return load_layer_skip(folder, target)
        if method == "mtp":  # the attention-free head, or DeepSeek-V3's block with attention (a model drafter)
            head = load_mtp(folder, target)
            return head if isinstance(head, MTPAttnDrafter) else MTPFeeder(head)
        if method == "dspark":
            return DSparkFeeder(load_dspark(folder, target))
        from transformers import AutoModelForCausalLM

        p = next(target.parameters())
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=p.dtype).to(p.device)
        drafter = DraftModelDrafter(model)
        drafter.check_target(target)
        return drafter
    except ValueError as exc:
        raise DrafterError(str(exc)) from None
