"""Load and save EAGLE-3 drafters in the two public layouts.

    drafter = load_drafter("path/to/eagle3", target=model)   # either layout, checked against the target
    drafter = load_drafter("default", target=model)          # the drafter shipped next to the target's folder
    save_drafter(drafter, "out/", target_name="default")     # vllm-project/speculators layout

SafeAILab EAGLE-3: config.json is a Llama config plus `draft_vocab_size` (layer ids, if
any, in `eagle_config.eagle_aux_hidden_state_layer_ids`); weights `fc.*`, `midlayer.*`,
`norm.weight`, `lm_head.weight`, `d2t`, `t2d` in model.safetensors or pytorch_model.bin.
speculators: config.json with `speculators_model_type: "eagle3"`, the layer config in
`transformer_layer_config`, `draft_vocab_size`, `norm_before_residual`,
`target_hidden_size`, `eagle_aux_hidden_state_layer_ids`, `speculators_config`; the
layer's weights under `layers.0.*`. `d2t` holds offsets: target id = draft id + d2t[id].
SafeAILab's published heads name no feature layers: with a target, EAGLE-3's default
(2, L//2, L-3) is used and logged, as vLLM does.

`"default"` names the drafter shipped *with the target*: the folder `<model>-drafter`
next to the target's own folder (or `<model>/drafter` inside it), found from the
target's `name_or_path`. That is how `probebus/models/default` finds
`probebus/models/default-drafter` without `decoder` importing `probebus`, and any
model folder can ship its drafter the same way.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ._confidence import ConfidenceHead
from ._eagle import Eagle3Config, Eagle3Drafter, default_aux_layers

log = logging.getLogger("decoder")


class DrafterError(ValueError):
    """A drafter checkpoint that is malformed or does not fit the target."""


def resolve_drafter_path(path: str | Path, target: nn.Module | None = None) -> Path:
    """A drafter folder: `path` itself, or for "default" the drafter shipped next to the target's folder."""
    if str(path) != "default" or Path(path).is_dir():
        return Path(path)
    if target is None:
        raise DrafterError("load_drafter('default') needs target=: the default drafter is the one shipped next "
                           "to the target model's folder")
    where = getattr(getattr(target, "config", None), "_name_or_path", "") or getattr(target, "name_or_path", "")
    if where:
        model = Path(where).resolve()
        for cand in (model.parent / f"{model.name}-drafter", model / "drafter"):
            if (cand / "config.json").is_file():
                return cand
    raise DrafterError(f"no drafter ships with the target {where or '(unknown folder)'}: expected "
                       "'<model>-drafter/' next to its folder or '<model>/drafter/' inside it; pass a drafter folder "
                       "or use the n-gram drafter")


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    st = folder / "model.safetensors"
    try:
        if st.is_file():
            return load_file(str(st))
        pt = folder / "pytorch_model.bin"
        if pt.is_file():  # the SafeAILab releases ship this; weights_only refuses arbitrary pickles
            return torch.load(str(pt), map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors and torch raise their own types for truncated or foreign files
        raise DrafterError(f"{folder}: cannot read the drafter weights ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else 'corrupt file'}); re-download or retrain "
                           "the drafter") from None
    raise DrafterError(f"{folder}: no model.safetensors or pytorch_model.bin")


def _layer_config(raw: dict) -> tuple[dict, str]:
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise DrafterError(f"speculators_model_type is {raw['speculators_model_type']!r}; "
                               "only 'eagle3' is supported")
        if "transformer_layer_config" not in raw:
            raise DrafterError("speculators config without transformer_layer_config")
        return raw["transformer_layer_config"], "speculators"
    return raw, "eagle3"


def load_drafter(path: str | Path, target: nn.Module | None = None, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> Eagle3Drafter:
    """Read a drafter folder in either layout (or "default": the one shipped with the target); with
    `target`, check it, bind the target's embedding and move it to the target's device.

    dtype: the drafter's compute dtype; default float32 on CPU (fast and exact there) and the
    target's dtype on accelerators. A `confidence.safetensors` trained for these weights is
    loaded as `drafter.confidence` (the round scheduler's acceptance estimate).
    """
    folder = resolve_drafter_path(path, target)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise DrafterError(f"{folder}: no config.json (is this an EAGLE-3 drafter folder?)")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DrafterError(f"{cfg_file}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise DrafterError(f"{cfg_file}: expected a JSON object")
    try:
        layer, layout = _layer_config(raw)
        return _build(folder, raw, layer, layout, target, dtype, device)
    except KeyError as exc:
        raise DrafterError(f"{cfg_file} lacks {exc}; not an EAGLE-3 drafter config") from None


def _build(folder: Path, raw: dict, layer: dict, layout: str, target: nn.Module | None, dtype: torch.dtype | None,
           device: torch.device | str | None) -> Eagle3Drafter:
    weights = _read_weights(folder)
    if layout == "speculators":
        weights = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                   for k, v in weights.items()}
    weights.pop("embed_tokens.weight", None)  # the target's embedding is shared, not duplicated
    missing = [k for k in ("fc.weight", "lm_head.weight", "norm.weight", "midlayer.self_attn.q_proj.weight")
               if k not in weights]
    if missing:
        raise DrafterError(f"{folder} ({layout} layout) lacks {missing}; not an EAGLE-3 checkpoint")
    hidden = int(layer["hidden_size"])
    heads = int(layer["num_attention_heads"])
    fc_in = weights["fc.weight"].shape[1]
    target_hidden = raw.get("target_hidden_size") or fc_in // 3
    if fc_in != 3 * target_hidden:
        raise DrafterError(f"fc takes {fc_in} inputs but target_hidden_size is {target_hidden} (expected 3x)")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    draft_vocab = int(raw.get("draft_vocab_size") or layer.get("draft_vocab_size") or layer["vocab_size"])
    if weights["lm_head.weight"].shape[0] != draft_vocab:
        raise DrafterError(f"lm_head has {weights['lm_head.weight'].shape[0]} rows but draft_vocab_size is "
                           f"{draft_vocab}")
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    cfg = Eagle3Config(
        hidden_size=hidden, target_hidden_size=int(target_hidden), num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads), intermediate_size=int(layer["intermediate_size"]),
        vocab_size=int(layer["vocab_size"]), draft_vocab_size=draft_vocab, aux_layer_ids=list(ids or []),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
        norm_before_residual=bool(raw.get("norm_before_residual", False)), fc_bias="fc.bias" in weights,
        max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
    )
    drafter = Eagle3Drafter(cfg)
    if "d2t" not in weights:  # no reduced vocabulary: identity mapping
        weights["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    if "t2d" not in weights:
        weights["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    try:
        drafter.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise DrafterError(f"{folder} ({layout} layout) does not match an EAGLE-3 drafter: {exc}") from None
    object.__setattr__(drafter, "confidence", ConfidenceHead.load(folder, drafter))
    drafter.source = str(folder)
    if target is not None:
        check_against_target(drafter, target)
        drafter.bind_target(target)
        param = next(target.parameters())
        device = device or param.device
        if dtype is None:
            dtype = torch.float32 if param.device.type == "cpu" else param.dtype
    drafter.to(device=device, dtype=dtype or torch.float32)
    if drafter.confidence is not None:
        drafter.confidence.to(device=device)  # the head stays float32: it is tiny
    return drafter.eval()


def check_against_target(drafter: Eagle3Drafter, target: nn.Module) -> None:
    """Clear errors for every mismatch that would otherwise silently collapse acceptance."""
    cfg, tc = drafter.config, target.config
    if cfg.target_hidden_size != tc.hidden_size:
        raise DrafterError(f"drafter expects target hidden size {cfg.target_hidden_size}, target has {tc.hidden_size}")
    if cfg.vocab_size != tc.vocab_size:
        raise DrafterError(f"drafter vocabulary {cfg.vocab_size} != target vocabulary {tc.vocab_size}")
    n = tc.num_hidden_layers
    if not cfg.aux_layer_ids:  # SafeAILab's published heads: EAGLE-3's (and vLLM's) default
        try:
            cfg.aux_layer_ids = default_aux_layers(n)
        except ValueError as exc:
            raise DrafterError(f"the checkpoint names no eagle_aux_hidden_state_layer_ids and {exc}") from None
        log.info("drafter names no eagle_aux_hidden_state_layer_ids: using EAGLE-3's default %s for this %d-layer "
                 "target", cfg.aux_layer_ids, n)
    if len(cfg.aux_layer_ids) != 3 or not all(0 <= i < n for i in cfg.aux_layer_ids):
        raise DrafterError(f"eagle_aux_hidden_state_layer_ids {cfg.aux_layer_ids} are not three layers of a "
                           f"{n}-layer target")
    if int((drafter.d2t + torch.arange(cfg.draft_vocab_size)).max()) >= cfg.vocab_size:
        raise DrafterError("d2t maps draft ids outside the target vocabulary")


def save_drafter(drafter: Eagle3Drafter, path: str | Path, *, target_name: str = "", k: int = 5) -> Path:
    """Write the vllm-project/speculators layout (config.json + model.safetensors)."""
    cfg = drafter.config
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {("layers.0." + k_[len("midlayer."):] if k_.startswith("midlayer.") else k_): v.detach().contiguous()
             for k_, v in drafter.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "num_hidden_layers": 1, "vocab_size": cfg.vocab_size,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings,
        },
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": target_name, "architectures": ["LlamaForCausalLM"]},
        },
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
