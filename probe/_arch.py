"""Map a stock Hugging Face model onto probebus site names.

    arch = resolve_arch(model)
    arch.sites()                      # ['embed', 'layers.0.resid_pre', ...]
    point = arch.locate("layers.3.attn_out")    # HookPoint(module=..., kind="post")

Every site is read at exactly one PyTorch hook point: the first input of a module
(`kind="pre"`) or its output (`kind="post"`, first element when the output is a
tuple). No model code is forked; the families below only differ in which submodule
holds what. Anything else with a recognisable decoder-layer list falls back to the
residual-stream sites, which are defined for every pre-norm transformer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

LAYER_SITES = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
GLOBAL_HEAD = ("embed",)
GLOBAL_TAIL = ("final_norm", "logits")


class SiteError(ValueError):
    """An unknown site, a bad pattern, or a site this architecture does not define."""


class ArchitectureError(ValueError):
    """The model's decoder-layer list (or another required part) cannot be found."""


@dataclass(frozen=True)
class HookPoint:
    module: nn.Module
    kind: str  # "pre": first input of module; "post": its output


@dataclass
class Arch:
    """Where each site lives inside one model instance."""

    family: str
    layers: list[nn.Module]
    embed: nn.Module | None
    final_norm: nn.Module | None
    lm_head: nn.Module | None
    # per-layer sub-site -> (attribute path under the layer, kind); resid_pre/post are implicit
    inner: dict[str, tuple[str, str]]

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def layer_site_names(self) -> tuple[str, ...]:
        return tuple(s for s in LAYER_SITES if s in ("resid_pre", "resid_post") or s in self.inner)

    def sites(self) -> list[str]:
        out = []
        if self.embed is not None:
            out.append("embed")
        for i in range(self.n_layers):
            out.extend(f"layers.{i}.{s}" for s in self.layer_site_names())
        if self.final_norm is not None:
            out.append("final_norm")
        if self.lm_head is not None:
            out.append("logits")
        return out

    def locate(self, site: str) -> HookPoint:
        """HookPoint of one concrete site name (no patterns)."""
        if site == "embed" and self.embed is not None:
            return HookPoint(self.embed, "post")
        if site == "final_norm" and self.final_norm is not None:
            return HookPoint(self.final_norm, "post")
        if site == "logits" and self.lm_head is not None:
            return HookPoint(self.lm_head, "post")
        parts = site.split(".")
        if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
            i, name = int(parts[1]), parts[2]
            if i < self.n_layers:
                layer = self.layers[i]
                if name == "resid_pre":
                    return HookPoint(layer, "pre")
                if name == "resid_post":
                    return HookPoint(layer, "post")
                if name in self.inner:
                    path, kind = self.inner[name]
                    return HookPoint(layer.get_submodule(path), kind)
        raise SiteError(f"site {site!r} is not defined for this {self.family} model; {self.describe()}")

    def describe(self) -> str:
        """One line listing what is available, for error messages."""
        glob = [s for s in ("embed",) if self.embed is not None]
        tail = [s for s, m in (("final_norm", self.final_norm), ("logits", self.lm_head)) if m is not None]
        layer = "layers.{0.." + str(self.n_layers - 1) + "}.{" + ", ".join(self.layer_site_names()) + "}"
        return "available sites: " + ", ".join(glob + [layer] + tail)


def _first_attr(obj: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    for n in names:
        m = getattr(obj, n, None)
        if isinstance(m, nn.Module):
            return m
    return None


def _find_layers(base: nn.Module) -> nn.ModuleList | None:
    named = _first_attr(base, ("layers", "h", "blocks", "layer"))
    if isinstance(named, nn.ModuleList) and len(named) > 0:
        return named
    # Generic fallback: the longest ModuleList whose children all share one class.
    best: nn.ModuleList | None = None
    for mod in base.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            if len({type(c) for c in mod}) == 1 and (best is None or len(mod) > len(best)):
                best = mod
    return best


def _has(layer: nn.Module, *paths: str) -> bool:
    for p in paths:
        try:
            layer.get_submodule(p)
        except AttributeError:
            return False
    return True


def resolve_arch(model: nn.Module) -> Arch:
    """Find embeddings, decoder layers, final norm and LM head of `model`."""
    base = getattr(model, "base_model", model)
    if base is None:
        base = model
    layers = _find_layers(base)
    if layers is None:
        raise ArchitectureError(
            f"cannot find a decoder-layer list in {type(model).__name__}: probebus looks for "
            "`layers`, `h`, `blocks` or a ModuleList of identical blocks. Supported families: "
            "Llama, Mistral, Qwen2, Qwen3, GPT-2, GPT-NeoX and other stock transformers decoders."
        )
    first = layers[0]
    embed = None
    get_in = getattr(model, "get_input_embeddings", None)
    if callable(get_in):
        try:
            embed = get_in()
        except (NotImplementedError, AttributeError):
            embed = None
    lm_head = None
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        try:
            lm_head = get_out()
        except (NotImplementedError, AttributeError):
            lm_head = None
    final_norm = _first_attr(base, ("norm", "ln_f", "final_layer_norm", "final_layernorm"))

    inner: dict[str, tuple[str, str]]
    # Families whose residual arithmetic is plain `x + attn(ln(x))`, `h + mlp(ln(h))`.
    extra_norms = _has(first, "pre_feedforward_layernorm") or _has(first, "post_feedforward_layernorm")
    if _has(first, "self_attn", "mlp", "input_layernorm", "post_attention_layernorm") and not extra_norms:
        family = "llama-like"
        inner = {
            "attn_out": ("self_attn", "post"),
            "resid_mid": ("post_attention_layernorm", "pre"),
            "mlp_out": ("mlp", "post"),
        }
    elif _has(first, "attn", "mlp", "ln_1", "ln_2"):
        family = "gpt2"
        inner = {"attn_out": ("attn", "post"), "resid_mid": ("ln_2", "pre"), "mlp_out": ("mlp", "post")}
    elif _has(first, "attention", "mlp", "post_attention_layernorm") and hasattr(first, "use_parallel_residual"):
        family = "gpt-neox"
        inner = {"attn_out": ("attention", "post"), "mlp_out": ("mlp", "post")}
        # With the parallel residual, attention and MLP both read resid_pre: no resid_mid exists.
        if not first.use_parallel_residual:
            inner["resid_mid"] = ("post_attention_layernorm", "pre")
    else:
        family = "generic"
        inner = {}
    return Arch(family, list(layers), embed, final_norm, lm_head, inner)
