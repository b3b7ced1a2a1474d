"""The MTP module with attention (DeepSeek-V3's multi-token prediction block), fed off the bus like EAGLE-3.

    head = load_mtp("probebus/models/default-mtp-attn", target)     # an MTPAttnDrafter
    with SpeculativeDecoder(target, head, k=4) as spec:              # reads `final_norm` off the bus
        out = spec.generate(ids, max_new_tokens=64)

One step at position t: x = eh_proj([hnorm(h_t); enorm(emb(x_{t+1}))]), then a pre-norm
transformer block over x (self-attention with RoPE over the module's own KV cache, then a SwiGLU
MLP), h' = its output, logits = head(norm(h')) with the target's own embedding and output head
(shared, frozen), predicting x_{t+2}. h_t is the target's `final_norm` state at t for every
accepted position (the module runs over all of them, so its cache holds the sequence's context);
each further draft step feeds its own h' and draft back, one module reused at every depth (as
vLLM runs DeepSeek-V3's single MTP layer for several speculative tokens).

This has the interface of an EAGLE-3 drafter (`EagleFeeder` reads its sites off the bus and
drives it; `train_drafter`'s training-time test unrolls it), with one feature site instead of
three, no `fc`, and the target's full vocabulary instead of a reduced draft vocabulary. The
attention-free MTP head (`_mtp.py`) is the cheaper variant.

Checkpoint (`save_mtp_attn`): `config.json` with `probebus_drafter: "mtp"`, `attention: true`,
`num_nextn_predict_layers: 1` and the block's sizes; `model.safetensors` with DeepSeek-V3's MTP
names: `enorm`, `hnorm`, `eh_proj`, `input_layernorm`, `self_attn.{q,k,v,o}_proj`,
`post_attention_layernorm`, `mlp.{gate,up,down}_proj`, `shared_head.norm`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ._eagle import DraftCache, Eagle3Config, Eagle3Drafter, Eagle3Layer, RMSNorm


class MTPLayer(Eagle3Layer):
    """eh_proj of the normed state and token embedding, then a pre-norm decoder layer (attention + MLP); RoPE,
    the cache write and the attention/MLP half are Eagle3Layer's."""

    def __init__(self, cfg: Eagle3Config) -> None:
        nn.Module.__init__(self)
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        self.enorm, self.hnorm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self._output_half(cfg)

    def project(self, emb: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        b, s, _ = hidden.shape
        x = self.eh_proj(torch.cat([self.hnorm(hidden), self.enorm(emb)], -1))
        y = self.input_layernorm(x)
        att = self.self_attn
        q = att.q_proj(y).view(b, s, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = att.k_proj(y).view(b, s, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = att.v_proj(y).view(b, s, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        return self._rope(q, positions), self._rope(k, positions), v, x


class MTPAttnDrafter(Eagle3Drafter):
    """DeepSeek-V3-style MTP block with attention; `bind_target` before use (embedding and head are the target's)."""

    sites = ["final_norm"]
    name = "mtp"

    def __init__(self, cfg: Eagle3Config) -> None:
        nn.Module.__init__(self)
        cfg.draft_vocab_size, cfg.aux_layer_ids = cfg.vocab_size, []
        self.config = cfg
        self.midlayer = MTPLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # DeepSeek's shared_head.norm
        self.register_buffer("d2t", torch.zeros(cfg.vocab_size, dtype=torch.long))  # the full vocabulary
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        object.__setattr__(self, "embed_tokens", None)
        object.__setattr__(self, "lm_head", None)
        object.__setattr__(self, "confidence", None)
        self.source = ""

    @classmethod
    def for_target(cls, target_config: object, *, intermediate_size: int | None = None) -> MTPAttnDrafter:
        cfg = Eagle3Config.for_target(target_config, aux_layer_ids=[0, 1, 2])
        if intermediate_size:
            cfg.intermediate_size = intermediate_size
        return cls(cfg)

    def bind_target(self, target: nn.Module) -> MTPAttnDrafter:
        super().bind_target(target)  # checks and shares the embedding
        head = target.get_output_embeddings()
        if head.weight.shape != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"the target's output head is {tuple(head.weight.shape)}, the MTP block expects "
                             f"({self.config.vocab_size}, {self.config.hidden_size}): wrong target")
        object.__setattr__(self, "lm_head", head)  # shared, frozen, never saved
        return self

    def new_cache(self, batch: int, max_len: int) -> DraftCache:
        p = self.norm.weight
        return DraftCache(batch, max_len, self.config.num_key_value_heads, self.config.head_dim, p.dtype, p.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The one feature site is the block's input as it is (no fc)."""
        return features.to(self.norm.weight.dtype)

    def fast(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DraftCache, int],
                               tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The step itself: EAGLE-3's fused step (`FastStep`) is shaped for EAGLE-3's own layer."""
        return self.step


def save_mtp_attn(drafter: MTPAttnDrafter, path: str | Path) -> Path:
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in drafter.state_dict().items():
        if k in ("d2t", "t2d"):
            continue
        name = "shared_head." + k if k.startswith("norm.") else k.removeprefix("midlayer.")
        state[name] = v.detach().contiguous()
    save_file(state, str(folder / "model.safetensors"))
    cfg = {"probebus_drafter": "mtp", "attention": True, "num_nextn_predict_layers": 1, **asdict(drafter.config)}
    for k in ("aux_layer_ids", "draft_vocab_size", "target_hidden_size", "norm_before_residual", "fc_bias"):
        cfg.pop(k)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


def load_mtp_attn(folder: Path, raw: dict, target: nn.Module) -> MTPAttnDrafter:
    """The block in `folder` (config already read into `raw`), bound to `target`; ValueError when they differ."""
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "vocab_size")
    try:
        cfg = Eagle3Config(**{k: int(raw[k]) for k in keys}, target_hidden_size=int(raw["hidden_size"]),
                           draft_vocab_size=int(raw["vocab_size"]),
                           rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                           rope_theta=float(raw.get("rope_theta", 10000.0)),
                           max_position_embeddings=int(raw.get("max_position_embeddings", 2048)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{folder}: an MTP block with attention needs {', '.join(keys)} in config.json: "
                         f"{exc}") from None
    drafter = MTPAttnDrafter(cfg)
    try:
        state = load_file(str(folder / "model.safetensors"))
        ours = {("norm." + k.removeprefix("shared_head.norm.")) if k.startswith("shared_head.norm.")
                else "midlayer." + k: v for k, v in state.items()}
        ours.update(d2t=drafter.d2t, t2d=drafter.t2d)
        drafter.load_state_dict(ours, strict=True)
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"{folder}: weights do not match the MTP block in config.json: {exc}") from None
    drafter.source = str(folder)
    p = next(target.parameters())
    return drafter.bind_target(target).to(device=p.device).eval()
