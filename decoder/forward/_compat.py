"""The name under which transformers takes a KV cache, which changed between its 5.x releases.

    kw = cache_kw(model.forward)          # "cache" (transformers 5.25 here), "past_key_values" (5.17)
    model(ids, use_cache=True, **{kw: cache})

transformers renamed `past_key_values` to `cache` on model forwards, `generate`, decoder layers and
`create_causal_mask`, keeping the old name as a deprecated alias for a while. An older release
has no `cache` argument at all: a forward given `cache=` took it into its `**kwargs` and ran
without the cache, silently (on 5.17 the loop's verify forwards saw only the new tokens, and a
tree verify's mask no longer matched its keys). So every call that hands over a cache names it
as the callee declares it; the lookup is done once per function.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

_NAMES = ("cache", "past_key_values", "past_key_value")


def cache_kw(fn: Callable) -> str:
    """The parameter of `fn` that takes the KV cache ("cache" where it declares none of the known names)."""
    return _lookup(getattr(fn, "__func__", fn))


@functools.lru_cache(maxsize=256)
def _lookup(fn: Callable) -> str:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or an odd callable: the current name
        return "cache"
    return next((name for name in _NAMES if name in params), "cache")
