"""Where each site lives in a vLLM Llama-family model, and the hooks that read it there.

    arch = VllmArch(runner.get_model())
    arch.sites()                               # every site of the whole model, in forward order
    arch.local_sites()                         # those this worker's pipeline stage computes
    handle = arch.hook("layers.3.resid_post", fn)   # fn(key, tensor) at each forward; handle.remove()

vLLM's decoder layers pass `(hidden_states, residual)` and fuse the residual add into
the next norm, which returns `(normed, hidden_states + residual)` (in place with vLLM's C
kernel on GPUs; the native op that 0.32's CPU build picks returns new tensors):
that second output is transformers' residual stream, so `resid_pre` and `resid_mid`
are read from the output of the norm that starts the layer / the MLP half, and
`resid_post` of layer i from the norm that starts layer i + 1 (the final norm after the
last layer), copied at once where an in-place kernel's next fused add would overwrite it
(decode steps on the CPU build wait for the step's end once a check on the running
engine has shown nothing writes into them: `_defer.py`). No add of our own
on the model's thread (a torch op per site per step costs dispatch time there: see
docs/design.md, "probebus on vLLM"); only a layer whose successor runs on another pipeline
stage sums its pair itself.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from .._arch import LAYER_SITES, ArchitectureError, SiteError
from .._hooks import tap
from .._sites import SiteKey

Stage = Callable[[SiteKey, torch.Tensor], None]  # what a hook hands a site's tensor to


class VllmArch:
    """Where each site lives in a vLLM Llama-family model (Llama, Mistral, Qwen2/3 ...)."""

    family = "vllm-llama-like"

    def __init__(self, model: nn.Module) -> None:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ArchitectureError(f"cannot find `model.layers` in vLLM's {type(model).__name__}; probebus on "
                                    "vLLM supports Llama-family decoders (Llama, Mistral, Qwen2, Qwen3)")
        self.model, self.inner, self.layers = model, inner, layers
        self.local = [i for i, layer in enumerate(layers) if _has(layer, "input_layernorm", "self_attn",
                                                                   "post_attention_layernorm", "mlp")]
        if not self.local and not any(type(layer).__name__ == "PPMissingLayer" for layer in layers):
            raise ArchitectureError(f"{type(layers[0]).__name__} is not a Llama-family decoder layer "
                                    "(input_layernorm, self_attn, post_attention_layernorm, mlp)")
        self.embed = getattr(inner, "embed_tokens", None)
        self.norm = getattr(inner, "norm", None)
        self.n_layers = len(layers)

    def sites(self) -> list[str]:
        """Every site of the whole model (all pipeline stages), in forward order."""
        out = ["embed"]
        out += [f"layers.{i}.{s}" for i in range(self.n_layers) for s in LAYER_SITES]
        return out + ["final_norm"]

    def local_sites(self) -> list[str]:
        """The sites this worker's pipeline stage computes."""
        out = ["embed"] if _is_module(self.embed) else []
        out += [f"layers.{i}.{s}" for i in self.local for s in LAYER_SITES]
        return out + (["final_norm"] if _is_module(self.norm) else [])

    def hook(self, site: str, fn: Stage) -> object:
        """Register the hook that hands `fn(key, tensor)` this site's tensor; returns its handle."""
        key = SiteKey.of(site)
        if site == "embed":
            return tap(self.embed, partial(_out, fn, key), pre=False)
        if site == "final_norm":
            return tap(self.norm, partial(_out, fn, key), pre=False)
        _, i, name = site.split(".")
        layer = self.layers[int(i)]
        if name == "resid_pre":
            return tap(layer.input_layernorm, partial(_stream, fn, key), pre=False)
        if name == "resid_post":
            nxt = int(i) + 1
            if nxt < self.n_layers and nxt in self.local:
                return tap(self.layers[nxt].input_layernorm, partial(_stream, fn, key), pre=False)
            if nxt == self.n_layers and _is_module(self.norm):
                return tap(self.norm, partial(_stream, fn, key), pre=False)
            return tap(layer, partial(_summed_out, fn, key), pre=False)  # the stage ends here
        if name == "attn_out":
            return tap(layer.self_attn, partial(_out, fn, key), pre=False)
        if name == "resid_mid":
            return tap(layer.post_attention_layernorm, partial(_stream, fn, key), pre=False)
        if name == "mlp_out":
            return tap(layer.mlp, partial(_out, fn, key), pre=False)
        raise SiteError(f"site {site!r} is not defined for vLLM models")


def _has(m: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(m, n, None), nn.Module) for n in names)


def _is_module(m: object) -> bool:
    return isinstance(m, nn.Module) and type(m).__name__ != "PPMissingLayer"


def _out(fn: Stage, key: SiteKey, module: nn.Module, args: tuple, output: object) -> None:
    fn(key, output[0] if isinstance(output, tuple) else output)


def _summed_out(fn: Stage, key: SiteKey, module: nn.Module, args: tuple,
                output: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    hidden, residual = output
    fn(key, hidden if residual is None else hidden + residual)


def _stream(fn: Stage, key: SiteKey, module: nn.Module, args: tuple, output: object) -> None:
    """A norm's view of the residual stream: its fused add's sum, or its input when it had no residual."""
    if isinstance(output, tuple):
        fn(key, output[1])
    elif args and isinstance(args[0], torch.Tensor):  # layer 0 on the first stage: the embedding output
        fn(key, args[0])


class SiteView:
    """What `expand_sites` needs of an architecture, for a vLLM model."""

    def __init__(self, arch: object) -> None:
        self._arch = arch
        self.family = arch.family  # type: ignore[attr-defined]
        self.n_layers = arch.n_layers  # type: ignore[attr-defined]

    def sites(self) -> list[str]:
        return self._arch.sites()  # type: ignore[attr-defined]

    def layer_site_names(self) -> tuple[str, ...]:
        return LAYER_SITES

    def describe(self) -> str:
        return (f"available sites: embed, layers.{{0..{self.n_layers - 1}}}.{{{', '.join(LAYER_SITES)}}}, "
                "final_norm (logits are computed outside vLLM's model forward and are not offered)")
