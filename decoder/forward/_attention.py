"""Grouped-query attention for the loop's forwards of several tokens: SDPA reads the shared K/V heads in place.

    with gqa_attention(target.config):         # inside `PackedLinears.active()`, around each of the loop's forwards
        logits = target(draft_ids, attention_mask=block, ...).logits

transformers' SDPA attention copies each K/V head `num_key_value_groups` times (`repeat_kv`) whenever a
forward has an attention mask and more than one token, which every verify forward of the loop has (its
additive 4-D mask, a tree's mask, a batch's padding). torch's SDPA takes `enable_gqa=True` and reads the
shared heads itself. On the default target (3 query heads, 1 K/V head) that makes a verify forward and the
loop a little faster, with logits bit for bit the same (measured: docs/design.md, "Decoder: measurements
behind the code").

The target's config names the attention implementation its layers call; during the loop's forwards it
names this one (registered with the masks of "sdpa", so transformers builds the same masks), and it is
put back after each, so the model's other forwards (the user's own `generate`) stay as they were.
Anything other than a masked forward of several tokens with grouped heads goes to transformers' own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

KEY = "probebus_sdpa_gqa"


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               is_causal: bool | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    if (attention_mask is not None and query.shape[2] > 1 and getattr(module, "num_key_value_groups", 1) > 1
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions", False)):
        # transformers' call with a mask (is_causal off), but GQA in the kernel instead of repeat_kv
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, is_causal=False, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _register() -> None:
    if KEY not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(KEY, _attention)
        AttentionMaskInterface.register(KEY, sdpa_mask)


@contextlib.contextmanager
def gqa_attention(config: object) -> Iterator[None]:
    """`config` (the target's) names this module's attention inside, if it named "sdpa" and has no sub-configs
    (whose own setting a plain write would leave behind)."""
    own = getattr(config, "__dict__", {})
    if own.get("_attn_implementation_internal") != "sdpa" or getattr(config, "sub_configs", None):
        yield
        return
    # not the property: its setter walks sub-configs, on every forward
    # (measured: docs/design.md, "Decoder: measurements behind the code")
    own["_attn_implementation_internal"] = KEY
    try:
        yield
    finally:
        own["_attn_implementation_internal"] = "sdpa"


_register()
