"""The EAGLE-3 drafter: one decoder layer over (token embedding, fused target features).

    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config))
    drafter.bind_target(target)                  # shares the target's frozen embedding
    cache = drafter.new_cache(batch, max_len)
    h, logits = drafter(drafter.fuse(features), next_ids, positions, cache)

Inputs at position t are the target features of t (resid_pre of three layers,
concatenated, projected by `fc`) and the embedding of token t+1; the output at t
predicts token t+2. For later draft steps the drafter's own pre-norm output is fed
back in place of `fc(features)`. The KV cache is indexed by absolute position, so
truncating after a rejection is a mask update, and rows of a batch may sit at
different positions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    norm_before_residual: bool = False
    fc_bias: bool = False
    max_position_embeddings: int = 2048

    @classmethod
    def for_target(cls, target_config: object, *, draft_vocab_size: int | None = None,
                   aux_layer_ids: list[int] | None = None) -> Eagle3Config:
        """A drafter shaped like one layer of `target_config` (a Llama-style config)."""
        c = target_config
        n_layers = c.num_hidden_layers
        heads = c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or {}
        return cls(
            hidden_size=c.hidden_size, target_hidden_size=c.hidden_size, num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size or c.vocab_size,
            aux_layer_ids=list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layers(n_layers),
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
            max_position_embeddings=getattr(c, "max_position_embeddings", 2048),
        )

    def to_dict(self) -> dict:
        return asdict(self)


def default_aux_layers(n_layers: int) -> list[int]:
    """EAGLE-3's default feature layers (2, L//2, L-3); they must be distinct."""
    ids = [2, n_layers // 2, n_layers - 3]
    if len(set(ids)) != 3 or min(ids) < 0:
        raise ValueError(f"a target with {n_layers} layers has no three distinct EAGLE-3 feature layers "
                         f"{ids}; pass aux_layer_ids explicitly")
    return ids


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


class DraftCache:
    """K/V indexed by absolute position; `valid[b, p]` says whether slot p of row b is live."""

    def __init__(self, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.k = torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)

    def truncate(self, keep_below: torch.Tensor) -> None:
        """Drop every slot at position >= keep_below[b] (per row)."""
        pos = torch.arange(self.valid.shape[1], device=self.valid.device)
        self.valid &= pos[None, :] < keep_below.to(pos.device)[:, None]


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self._output_half(cfg)

    def _output_half(self, cfg: Eagle3Config) -> None:
        """o_proj, the SwiGLU MLP and the RoPE tables: what follows q/k/v (shared with the MTP block)."""
        h, hd = cfg.hidden_size, cfg.head_dim
        self.self_attn.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        self.register_buffer("inv_freq", inv, persistent=False)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        need = int(positions.max()) + 1
        if self._cos is None or self._cos.shape[0] < need or self._cos.dtype != x.dtype:
            # cos/sin for every position once: per-call trigonometry was a visible share of a draft step
            n = max(need, self.cfg.max_position_embeddings)
            ang = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)[:, None] * self.inv_freq
            self._cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
            self._sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]  # [B, 1, S, hd]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def project(self, emb: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [B,nh,S,hd], k, v [B,nkv,S,hd], residual) for one block of inputs."""
        cfg = self.cfg
        b, s, _ = hidden.shape
        if cfg.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(emb), hidden], -1)
        att = self.self_attn
        q = att.q_proj(x).view(b, s, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = att.k_proj(x).view(b, s, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = att.v_proj(x).view(b, s, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        return self._rope(q, positions), self._rope(k, positions), v, residual

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               residual: torch.Tensor) -> torch.Tensor:
        """Attention of q over (k, v) under a boolean mask [B|1, S, T], then the MLP block."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
        b, _, s, _ = q.shape
        h = residual + self.self_attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        m = self.mlp
        y = self.post_attention_layernorm(h)
        return h + m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y))

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: DraftCache, span: int | None = None) -> torch.Tensor:
        """One block of inputs at `positions` [B, S]; `span` (1 + the largest position) saves a sync."""
        q, k, v, residual = self.project(emb, hidden, positions)
        b, nkv, s, hd = k.shape
        if s == 1:  # a draft step: one slot per row, written in place
            rows = torch.arange(b, device=positions.device)
            at = positions[:, 0]
            cache.k[rows, :, at] = k[:, :, 0]
            cache.v[rows, :, at] = v[:, :, 0]
            cache.valid[rows, at] = True
        else:
            idx = positions[:, None, :, None].expand(b, nkv, s, hd)
            cache.k.scatter_(2, idx, k)
            cache.v.scatter_(2, idx, v)
            cache.valid.scatter_(1, positions, True)
        span = int(positions.max()) + 1 if span is None else span
        valid = cache.valid[:, None, :span]
        if s == 1:  # slots after a row's own position were truncated before drafting: no causal term needed
            mask = valid
        else:
            keys_pos = torch.arange(span, device=positions.device)
            mask = valid & (keys_pos[None, None, :] <= positions[:, :, None])  # [B, S, span]
        return self.attend(q, cache.k[:, :, :span], cache.v[:, :, :span], mask, residual)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 head; `bind_target` before use (embedding is the target's, frozen)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None
        # the acceptance estimate for the scheduler (decoder._confidence); not a submodule, never saved here
        object.__setattr__(self, "confidence", None)
        self.source = ""

    def bind_target(self, target: nn.Module) -> Eagle3Drafter:
        emb = target.get_input_embeddings()
        if emb.weight.shape != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"target embedding is {tuple(emb.weight.shape)}, the drafter expects "
                             f"({self.config.vocab_size}, {self.config.hidden_size}): wrong target for this drafter")
        object.__setattr__(self, "embed_tokens", emb)  # shared, not a submodule: never saved, never trained
        return self

    def new_cache(self, batch: int, max_len: int) -> DraftCache:
        p = self.fc.weight
        return DraftCache(batch, max_len, self.config.num_key_value_heads, self.config.head_dim, p.dtype, p.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[B, S, 3 * target_hidden] target features (any float dtype) -> drafter hidden."""
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                cache: DraftCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm output to feed back, draft-vocabulary logits) for each input position."""
        h, _, logits = self.step(hidden, next_ids, positions, cache)
        return h, logits

    def step(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, cache: DraftCache,
             span: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre-norm output, normed output, draft logits): the normed output feeds the confidence head."""
        if self.embed_tokens is None:
            raise RuntimeError("call drafter.bind_target(target) first: EAGLE-3 uses the target's embedding")
        with torch.no_grad():
            emb = self.embed_tokens(next_ids)
        h = self.midlayer(emb.to(hidden.dtype), hidden, positions, cache, span)
        hn = self.norm(h)
        return h, hn, self.lm_head(hn)

    def fast(self) -> FastStep:
        """The inference step with fused weights (built once; call `refresh_fast()` after changing weights)."""
        if getattr(self, "_fast", None) is None:
            object.__setattr__(self, "_fast", FastStep(self))
        return self._fast

    def refresh_fast(self) -> None:
        object.__setattr__(self, "_fast", None)

    def draft_to_target_ids(self) -> torch.Tensor:
        """Target id of every draft id, [draft_vocab]."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target vocabulary ids of draft-vocabulary ids (d2t holds offsets)."""
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits scattered onto the target vocabulary (-inf outside the draft vocab)."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        idx = torch.arange(self.config.draft_vocab_size, device=draft_logits.device)
        out[..., self.to_target(idx)] = draft_logits
        return out


class FastStep:
    """Inference-only drafter step with fewer, larger ops: q/k/v and gate/up fused into one matmul each,
    fused RMSNorm, RoPE tables indexed once, no module-call overhead. Same math as `Eagle3Drafter.step`
    (float rounding aside). Built from the weights as they are now: rebuild after changing them.

        fast = drafter.fast()
        h, hn, logits = fast(hidden, next_ids, positions, cache, span)
    """

    def __init__(self, d: Eagle3Drafter) -> None:
        layer, cfg = d.midlayer, d.config
        att, mlp = layer.self_attn, layer.mlp
        with torch.no_grad():
            self.wqkv = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).detach().clone()
            self.wgu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().clone()
        self.wo, self.wd = att.o_proj.weight.detach(), mlp.down_proj.weight.detach()
        self.lm = d.lm_head.weight.detach()
        self.norms = [n.weight.detach() for n in (layer.input_layernorm, layer.hidden_norm,
                                                   layer.post_attention_layernorm, d.norm)]
        self.eps = cfg.rms_norm_eps
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.split = [self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd]
        self.inter = cfg.intermediate_size
        self.norm_before_residual = cfg.norm_before_residual
        self.embed = d.embed_tokens
        dtype = self.wqkv.dtype
        n = cfg.max_position_embeddings
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd)
        ang = torch.arange(n, dtype=torch.float32)[:, None] * inv
        self.cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype).to(self.wqkv.device)
        self.sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype).to(self.wqkv.device)

    def _norm(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.norms[i], self.eps)
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.norms[i] * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, cache: DraftCache,
                 span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.body(hidden, next_ids, positions, cache, span)
        return (h, *self.head(h))

    @torch.no_grad()
    def head(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output, draft logits) of the layer's output h."""
        hn = self._norm(h, 3)
        return hn, F.linear(hn, self.lm)

    @torch.no_grad()
    def body(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, cache: DraftCache,
             span: int) -> torch.Tensor:
        """The layer's output (pre-norm, fed back as the next step's hidden) at every input position."""
        if span > self.cos.shape[0]:
            raise ValueError(f"position {span - 1} is beyond the drafter's max_position_embeddings "
                             f"{self.cos.shape[0]}")
        b, s, _ = hidden.shape
        emb = self.embed(next_ids).to(hidden.dtype)
        if self.norm_before_residual:
            hidden = self._norm(hidden, 1)
            residual = hidden
        else:
            residual = hidden
            hidden = self._norm(hidden, 1)
        x = torch.cat([self._norm(emb, 0), hidden], -1)
        q, k, v = F.linear(x, self.wqkv).split(self.split, -1)
        q = q.view(b, s, self.nh, self.hd).transpose(1, 2)
        k = k.view(b, s, self.nkv, self.hd).transpose(1, 2)
        v = v.view(b, s, self.nkv, self.hd).transpose(1, 2)
        one = b == 1 and s == 1  # one new token of one row: int indices, views and copies, no gathers
        if one:
            at = int(positions[0, 0])
            cos, sin = self.cos[at], self.sin[at]
        else:
            cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        if one:
            cache.k[0, :, at] = k[0, :, 0]
            cache.v[0, :, at] = v[0, :, 0]
            cache.valid[0, at] = True
            mask = cache.valid[:, None, None, :span]
        elif s == 1:
            rows = torch.arange(b, device=positions.device)
            at = positions[:, 0]
            cache.k[rows, :, at] = k[:, :, 0]
            cache.v[rows, :, at] = v[:, :, 0]
            cache.valid[rows, at] = True
            mask = cache.valid[:, None, None, :span]
        else:
            idx = positions[:, None, :, None].expand(b, self.nkv, s, self.hd)
            cache.k.scatter_(2, idx, k)
            cache.v.scatter_(2, idx, v)
            cache.valid.scatter_(1, positions, True)
            keys = torch.arange(span, device=positions.device)
            mask = (cache.valid[:, None, :span] & (keys[None, None, :] <= positions[:, :, None]))[:, None]
        out = F.scaled_dot_product_attention(q, cache.k[:, :, :span], cache.v[:, :, :span], attn_mask=mask,
                                             enable_gqa=True)
        h = residual + F.linear(out.transpose(1, 2).reshape(b, s, -1), self.wo)
        gate, up = F.linear(self._norm(h, 2), self.wgu).split(self.inter, -1)
        return h + F.linear(F.silu(gate) * up, self.wd)
