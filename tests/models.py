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
def _dec(layers: int) -> dict:
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, **_COMMON)


def _neox(layers: int, **kw: object) -> GPTNeoXConfig:
    return GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         max_position_embeddings=256, **_COMMON, **kw)


FAMILIES = {
    "llama": lambda n: LlamaForCausalLM(LlamaConfig(**_dec(n))),
    "mistral": lambda n: MistralForCausalLM(MistralConfig(**_dec(n), sliding_window=None)),
    "qwen2": lambda n: Qwen2ForCausalLM(Qwen2Config(**_dec(n))),
    "qwen3": lambda n: Qwen3ForCausalLM(Qwen3Config(**_dec(n), head_dim=16)),
    "gpt2": lambda n: GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=n, n_head=4, n_positions=256, **_COMMON)),
    "gpt-neox": lambda n: GPTNeoXForCausalLM(_neox(n)),
    "gpt-neox-sequential": lambda n: GPTNeoXForCausalLM(_neox(n, use_parallel_residual=False)),
}


def build(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return FAMILIES[family](layers).to(dtype).eval()


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def oracle_activations(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every site's activation for the batch `ids`, with no probe attached: resid_pre / resid_post, final_norm and
    logits from transformers' `output_hidden_states`, each layer's sub-layer outputs and the last layer's
    resid_post (hidden_states has it normed) from plain forward hooks that clone at once. resid_mid is left out."""
    import probe

    arch = probe.resolve_arch(model)
    got: dict[str, torch.Tensor] = {}

    def keeper(key: str):
        def keep(mod, args, out) -> None:
            got[key] = (out[0] if isinstance(out, tuple) else out).detach().clone()
        return keep

    handles = [layer.get_submodule(path).register_forward_hook(keeper(f"layers.{i}.{name}"))
               for name, (path, _kind) in arch.inner.items() if name != "resid_mid"
               for i, layer in enumerate(arch.layers)]
    handles.append(arch.layers[-1].register_forward_hook(keeper(f"layers.{arch.n_layers - 1}.resid_post")))
    try:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    hs = out.hidden_states
    for i in range(arch.n_layers):
        got[f"layers.{i}.resid_pre"] = hs[i].clone()
        if i < arch.n_layers - 1:
            got[f"layers.{i}.resid_post"] = hs[i + 1].clone()
    got["final_norm"] = hs[arch.n_layers].clone()
    got["logits"] = out.logits.clone()
    return got
