"""probe: capture a Hugging Face model's internal states and publish them over ZeroMQ.

    import probe
    probe.list_sites(model)                         # every site this model defines
    with probe.attach(model, "layers.*.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)    # here or in another process
        session.wait_for_subscribers(1)
        model.generate(**inputs, max_new_tokens=8)
    for cap in sub.iter(idle_timeout=0.5):
        cap.site, cap.seq_ids, cap.positions, cap.tensor

See DESIGN.md ("probe internals") for the hook / ring / publisher split.
"""

from __future__ import annotations

from torch import nn

from ._arch import ArchitectureError, SiteError, resolve_arch
from ._session import ProbeSession, ProbeStats, attach
from ._sites import SiteMatcher, expand_sites
from ._subscriber import Capture, Subscriber, SubscriberStats, parse_capture
from ._wire import PHASES, VERSION, WireError

__version__ = "0.1.0"


def list_sites(model: nn.Module) -> list[str]:
    """Every site name defined for `model`, in forward order."""
    return resolve_arch(model).sites()


def match_sites(model: nn.Module, sites: str | list[str]) -> list[str]:
    """Concrete site names a pattern selects on `model` (raises SiteError with the options)."""
    return expand_sites(resolve_arch(model), sites)


__all__ = [
    "ArchitectureError", "Capture", "PHASES", "ProbeSession", "ProbeStats", "SiteError", "SiteMatcher",
    "Subscriber", "SubscriberStats", "VERSION", "WireError", "attach", "list_sites", "match_sites",
    "parse_capture",
]
