"""probe: capture a Hugging Face model's internal states and publish them over ZeroMQ.

    import probe
    probe.list_sites(model)                         # every site this model defines
    with probe.attach(model, "layers.*.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)    # here or in another process
        session.wait_for_subscribers(1)
        model.generate(**inputs, max_new_tokens=8)
    for cap in sub:                                 # ends with the session's end of stream
        cap.site, cap.seq_ids, cap.positions, cap.tensor
    probe.live_sessions()                           # this user's running sessions

Internals, in the order a capture meets them: `_arch` / `_sites` (where each site is
hooked), `_session` (attach and the public API), `_hooks` (the hooks: the hot path),
`_identity` (whose token each row is), `_copy` (rows into a message, staging ring for
large ones), `_publisher` (the socket: policies, subscribers, end of stream), `_wire`
(the frames), `_subscriber`; the `vllm` package for vLLM engines. The README's
design notes explain why each is the way it is.
"""

from __future__ import annotations

from torch import nn

from ._arch import ArchitectureError, SiteError, resolve_arch
from ._capture import Capture, parse_capture
from ._discovery import SessionInfo, live_sessions, runtime_dir
from ._session import ProbeSession, attach
from ._sites import SiteMatcher, expand_sites
from ._stats import ProbeStats
from ._subscriber import Subscriber, SubscriberStats
from ._version import __version__ as __version__
from ._wire import DTYPE_CODE, DTYPE_NAME, DTYPES, PHASES, VERSION, WireError


def list_sites(model: nn.Module) -> list[str]:
    """Every site name defined for `model`, in forward order."""
    return resolve_arch(model).sites()


def match_sites(model: nn.Module, sites: str | list[str]) -> list[str]:
    """Concrete site names a pattern selects on `model` (raises SiteError with the options)."""
    return expand_sites(resolve_arch(model), sites)


__all__ = [
    "ArchitectureError", "Capture", "DTYPES", "DTYPE_CODE", "DTYPE_NAME", "PHASES", "ProbeSession", "ProbeStats",
    "SessionInfo", "SiteError", "SiteMatcher", "Subscriber", "SubscriberStats", "VERSION", "WireError", "attach",
    "list_sites", "live_sessions", "match_sites", "parse_capture", "resolve_arch", "runtime_dir",
]
