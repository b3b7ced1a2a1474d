"""Small random models of every supported family, built from configs (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 128
PAD = 0
EOS = 1

_COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=2)
_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, **_COMMON)

FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_DECODER)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_DECODER, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_DECODER)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_DECODER, head_dim=16)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=256, **_COMMON)),
    "gpt-neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                                          num_attention_heads=4, max_position_embeddings=256,
                                                          **_COMMON)),
    "gpt-neox-sequential": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=256, use_parallel_residual=False, **_COMMON)),
}


def build(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = FAMILIES[family]().to(dtype).eval()
    # Make the random weights larger so activations are not all tiny (a real test of atol).
    return model


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask
