"""Taps inside a compiled model: what a tap does while torch.compile traces it.

    model.forward = torch.compile(model.forward, fullgraph=True)   # before or after attach
    with probe.attach(model, "layers.*.resid_post") as s:
        model.generate(**inputs, cache_implementation="static")     # captured as in eager mode

While Dynamo traces a tapped module (`torch.compiler.is_compiling()`), its wrapper does not run the
site taps: it appends `(module, is_input, tensor)` to one global list (`_hooks._traced`, through
`_hooks._stage_traced`), which the step's end hands to the sessions whose sites are on that module
(`_hooks.route_traced`, `Hooks._gather`). (A wrapper that also carries callbacks other than site taps
runs them, and each site tap appends its tensor to a list of its own, `Hooks._slots`.)
Dynamo records that as a side effect of the graph: the tensor becomes one more output of the
graph, and once the graph has run the list holds the real tensors. The graph stays whole
(`fullgraph=True` holds), Inductor compiles the model as it would without probes, and nothing
of probebus runs inside it. The step's end, which runs as eager code after the graph, hands each
tensor to the copy path as an eager tap would (`Hooks._take_staged`): a deferred capture of a small
step, a copy of a larger one. A graph output is a fresh tensor that nothing writes into later.

The step's identity is read outside the graph: the model's step hooks are `nn.Module` hooks,
which run in `Module.__call__`, around a compiled `forward`. Where the whole call is compiled
(`torch.compile(model)` or `model.__call__`, transformers' compiled generate), they are also marked
for Dynamo to run as eager code (`eager`) in case it traces them; with torch 2.13 both of those
compile with `fullgraph=True` and the hooks run outside the graph (tested with a probed session).

Recompiles: Dynamo guards on a module's `forward`, so attaching to a model compiled earlier
compiles it once more with the taps in it (each graph: the prefill's and the decode step's). A
tapped module's wrapper is one of three functions (what it stages: output, input, both), the same code
whichever session puts it back, so taking the taps
off (close, pause) goes back to the graphs compiled without them, and putting the same set back
(resume, a second session) finds its graphs in Dynamo's cache: neither compiles anything. Each
other set of tapped modules (another site list, `remove()` of a module's last site) is one more
compile, and one more entry of Dynamo's cache, which `torch._dynamo.config.recompile_limit`
bounds (8 by default; past it Dynamo runs the code eagerly, or fails under `fullgraph=True`).
Measured in docs/benchmarks.md (Compiled models).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

_numbers: dict[str, int] = {}


def number(site: str) -> int:
    """The number a traced tap stages its site's tensor under: one per site name in this process, so that a tap
    put back (resume, a second session) carries the same constant into the graph and Dynamo's guards, which
    compare it, find the graph compiled before instead of compiling another."""
    return _numbers.setdefault(site, len(_numbers))


def eager(fn: Callable) -> Callable:
    """`fn`, which Dynamo will run as eager code wherever it meets it inside a compiled call (with what it calls).
    Dynamo is loaded by transformers before any model is; where it is not, nothing compiles the model yet.

    Marked on its code object where this torch has the means (Dynamo then skips its frame and every frame it
    calls, as `torch._dynamo.disable` does), so that an eager call, the documented path's (`model.forward =
    torch.compile(model.forward)`: the step hooks run in `Module.__call__`), costs nothing more; `disable`'s
    wrapper set and restored Dynamo's frame callback on every call (docs/design.md, "Costs behind the code",
    Compiled step). Elsewhere, `disable`'s wrapper."""
    if "torch._dynamo" not in sys.modules:
        return fn
    try:
        from torch._dynamo.eval_frame import FrameAction, FrameExecStrategy, set_code_exec_strategy
    except ImportError:  # (torch 2.13 has it)
        return torch._dynamo.disable(fn, reason="probebus: a step's identity is read outside the graph")
    set_code_exec_strategy(getattr(fn, "__func__", fn).__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return fn
