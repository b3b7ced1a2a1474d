"""The site grammar: names and patterns, TransformerLens style.

    expand_sites(arch, "layers.*.resid_post")        # every layer
    expand_sites(arch, ["layers.0:8.mlp_out", "logits"])
    expand_sites(arch, "layers.-3.resid_pre")        # third-from-last layer
    expand_sites(arch, "*.resid_post")               # a shell glob over the site names
    expand_sites(arch, "resid_post")                 # part of a name: every layer's resid_post
    SiteMatcher(["layers.*.resid_post"]).matches("layers.4.resid_post")  # no model needed

A pattern is `embed`, `final_norm`, `logits`, `*` (everything) or
`layers.SEL.NAME` where SEL is `*`, an index (negative counts from the end) or a
Python slice `a:b[:c]`, and NAME is a layer site or `*`. Anything else is read
loosely, as people type it: a shell glob (`*.resid_post`, `layers.1?.mlp_out`) over
the site names, or part of a name: whole dot-separated parts where it is made of them
(`resid_post`, `layers.3`, `3.mlp_out`), else any substring (`resid`, `mlp`).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from typing import NamedTuple

from ._arch import GLOBAL_HEAD, GLOBAL_TAIL, LAYER_SITES, Arch, SiteError

_LAYER_RE = re.compile(r"^layers\.(?P<sel>[^.]+)\.(?P<name>[a-z_]+|\*)$")
_INT_RE = re.compile(r"^-?\d+$")
_SLICE_RE = re.compile(r"^(-?\d*):(-?\d*)(?::(-?\d+))?$")


GRAMMAR = ("patterns: a site (layers.3.resid_post, embed, final_norm, logits), layers.SEL.NAME with SEL = * | 3 | "
           "-1 | 2:6 and NAME a layer site or *, a shell glob (*.resid_post), or part of a name (resid_post, mlp); "
           "several joined by commas")


def _is_part(token: str) -> bool:
    return token in ("layers", *LAYER_SITES, *GLOBAL_HEAD, *GLOBAL_TAIL) or bool(_INT_RE.match(token))


def loose_match(pattern: str, site: str) -> bool:
    """A pattern outside the strict grammar: a shell glob, whole dot-separated parts of a name, or a substring."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(site, pattern)
    if all(_is_part(t) for t in pattern.split(".")):
        return f".{pattern}." in f".{site}."
    return pattern in site


def _strict(pattern: str) -> re.Match[str] | None:
    """layers.SEL.NAME of the strict grammar; None for anything else (a glob such as layers.1?.mlp_out included)."""
    m = _LAYER_RE.match(pattern)
    if m and m["sel"] != "*" and any(c in m["sel"] for c in "*?["):
        return None
    return m


def _as_list(sites: str | Iterable[str]) -> list[str]:
    if isinstance(sites, str):
        items = [s.strip() for s in sites.split(",")]
    else:
        items = [s.strip() for s in sites]
    items = [s for s in items if s]
    if not items:
        raise SiteError("no sites given; pass a site name or pattern such as 'layers.*.resid_post'")
    return items


def _select_layers(sel: str, n_layers: int | None, pattern: str) -> range | list[int] | None:
    """Layer indices selected by SEL; None means "all" when n_layers is unknown."""
    if sel == "*":
        return None if n_layers is None else range(n_layers)
    if _INT_RE.match(sel):
        i = int(sel)
        if n_layers is None:
            if i < 0:
                raise SiteError(f"{pattern!r}: a negative layer index needs the model; use a concrete index")
            return [i]
        if not -n_layers <= i < n_layers:
            raise SiteError(f"{pattern!r}: layer {i} out of range; the model has {n_layers} layers (0..{n_layers - 1})")
        return [i % n_layers]
    m = _SLICE_RE.match(sel)
    if m:
        a, b, c = (int(x) if x else None for x in m.groups())
        if n_layers is None:
            if any(x is not None and x < 0 for x in (a, b)) or b is None:
                raise SiteError(f"{pattern!r}: open or negative slices need the model; use a:b with a, b >= 0")
            return range(a or 0, b, c or 1)
        return range(n_layers)[slice(a, b, c)]
    raise SiteError(f"{pattern!r}: bad layer selector {sel!r}; use '*', an index like 3 or -1, or a slice like 2:6")


def expand_sites(arch: Arch, sites: str | Iterable[str]) -> list[str]:
    """Concrete site names selected by `sites`, in model order, without duplicates."""
    available = arch.sites()
    chosen: set[str] = set()
    for pat in _as_list(sites):
        if pat == "*":
            chosen.update(available)
            continue
        if pat in GLOBAL_HEAD + GLOBAL_TAIL:
            if pat not in available:
                raise SiteError(f"site {pat!r} is not defined for this {arch.family} model; {arch.describe()}")
            chosen.add(pat)
            continue
        m = _strict(pat)
        if not m:
            loose = [s for s in available if loose_match(pat, s)]
            if not loose:
                raise SiteError(f"unknown site {pat!r}: it selects nothing; {GRAMMAR}; {arch.describe()}")
            chosen.update(loose)
            continue
        name = m["name"]
        names = arch.layer_site_names() if name == "*" else (name,)
        for n in names:
            if n not in LAYER_SITES:
                raise SiteError(f"unknown layer site {n!r} in {pat!r}; {GRAMMAR}; {arch.describe()}")
            if n not in arch.layer_site_names():
                raise SiteError(
                    f"{n!r} is not defined for this {arch.family} model (e.g. a parallel-residual block "
                    f"has no resid_mid); {arch.describe()}"
                )
        layers = _select_layers(m["sel"], arch.n_layers, pat)
        assert layers is not None
        if len(layers) == 0:
            raise SiteError(f"{pat!r} selects no layer; the model has {arch.n_layers} layers")
        chosen.update(f"layers.{i}.{n}" for i in layers for n in names)
    return [s for s in available if s in chosen]


class SiteKey(NamedTuple):
    """A site as the copy path keys it: its name, the name as the wire's topic, its layer (-1: global)."""

    name: str
    topic: bytes
    layer: int

    @classmethod
    def of(cls, site: str) -> SiteKey:
        return cls(site, site.encode(), site_layer(site))


def site_layer(site: str) -> int:
    """Layer index of a site name, -1 for global sites."""
    if site.startswith("layers."):
        return int(site.split(".")[1])
    return -1


# a site name of some layer (any index), to tell a part of a name from a typo without the model
_KNOWN_NAMES = (*GLOBAL_HEAD, *GLOBAL_TAIL, *(f"layers.0.{n}" for n in LAYER_SITES))


def _is_site_name(site: str) -> bool:
    parts = site.split(".")
    if len(parts) == 3:
        return parts[0] == "layers" and parts[1].isdigit() and parts[2] in LAYER_SITES
    return site in GLOBAL_HEAD + GLOBAL_TAIL


class SiteMatcher:
    """Match site names against patterns without knowing the model (for subscribers).

    `topics()` gives the ZeroMQ prefixes to subscribe to; `matches()` filters exactly.
    """

    def __init__(self, sites: str | Iterable[str] | None) -> None:
        self.exact: set[str] = set()
        self._rules: list[tuple[range | None, str]] = []
        self._loose: list[str] = []  # globs and parts of names (`loose_match`)
        self.everything = sites is None
        if sites is None:
            return
        for pat in _as_list(sites):
            if pat == "*":
                self.everything = True
            elif pat in GLOBAL_HEAD + GLOBAL_TAIL:
                self.exact.add(pat)
            else:
                m = _strict(pat)
                if m and m["name"] != "*" and m["name"] not in LAYER_SITES:
                    raise SiteError(
                        f"unknown site {pat!r}; sites are embed, layers.N.{{{', '.join(LAYER_SITES)}}}, "
                        f"final_norm, logits; {GRAMMAR}"
                    )
                if not m:  # a glob or part of a name: matched by name; every topic is read
                    typo = not any(c in pat for c in "*?[0123456789")  # else it may name a layer we cannot see
                    if typo and not any(loose_match(pat, s) for s in _KNOWN_NAMES):
                        raise SiteError(f"unknown site {pat!r}: no site name contains it; {GRAMMAR}")
                    self._loose.append(pat)
                    continue
                sel = _select_layers(m["sel"], None, pat)
                if isinstance(sel, list) and m["name"] != "*":
                    self.exact.add(f"layers.{sel[0]}.{m['name']}")
                else:
                    self._rules.append((sel, m["name"]))

    def topics(self) -> list[bytes]:
        if self.everything or self._loose:
            return [b""]
        topics = {s.encode() for s in self.exact}
        if self._rules:
            topics.add(b"layers.")
        return sorted(topics)

    def matches(self, site: str) -> bool:
        """Whether a concrete site name is selected (False for anything that is not a site name)."""
        if self.everything or site in self.exact:
            return True
        if any(loose_match(p, site) for p in self._loose) and _is_site_name(site):
            return True
        if not self._rules or not site.startswith("layers."):
            return False
        parts = site.split(".")
        if len(parts) != 3 or not parts[1].isdigit():
            return False
        layer, name = int(parts[1]), parts[2]
        return any((sel is None or layer in sel) and (want == "*" or want == name) for sel, want in self._rules)
