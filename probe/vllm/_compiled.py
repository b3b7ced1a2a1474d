"""Probes inside vLLM's compiled model (its default mode: Dynamo + Inductor), switched on and off at run time.

    llm = LLM(model=path, **probe.vllm.ENGINE_KWARGS)           # no enforce_eager needed
    with probe.vllm.attach(llm, "layers.*.resid_post") as s:    # as in eager mode
        llm.generate(prompts, params)

vLLM compiles the inner model (`support_torch_compile` on `LlamaModel`) once, in the engine's
start-up (the CPU worker's warm-up run), and from then on calls the compiled code without
Dynamo's guard checks: a tap added after that is never run. So the taps go in before.
vLLM imports the worker extension (`probe.vllm`) in each worker before it builds the model;
that import registers a module-registration hook (`watch`: it costs nothing per forward),
and when a worker of an engine started with the extension builds a model that vLLM will
compile, every site the worker computes gets a dormant tap (`Dormant`). Traced by Dynamo, a
tap appends `(site number, tensor)` to a list, which Dynamo records as a side effect: the
tensor becomes one more output of the graph and, once the compiled code has run, the list
holds it (the transformers backend does the same, `probe/_compiled.py`). The outer model
(`LlamaForCausalLM`) is not compiled: its taps run as eager code around the compiled call,
read the step's identity before it (`_identity.py`, unchanged) and after it hand the
staged tensors of the attached session's sites to the copy path, exactly as an eager tap
would; with no session attached (or paused) they drop them. Attach, pause, resume and detach
compile nothing: they only set which session, if any, the dormant taps serve.

What the taps cost while dormant: each compiled forward returns every site's tensor too, the
list is appended to (Python, after the graph) and cleared, and those tensors live until the
step's end instead of being freed or reused inside the graph (a prefill of T tokens holds
sites x T x hidden more numbers for that long). A decode step of a tapped engine measured 0.92-1.06x
a clean engine's, within the spread between engines of one kind (`benchmarks/vllm_engines.py`,
docs/benchmarks.md, Compiled models); the engine's start with and without the taps, and attach and
close (RPC and the bus's sockets: nothing compiles), are in docs/design.md, "Costs behind the code",
Compiled vLLM.

vLLM 0.32 saves compiled models in its cache (~/.cache/vllm/torch_compile_cache) under a hash
of the engine's config, which leaves out `worker_extension_cls`: a model compiled without the
taps would be loaded into a tapped engine and run none of them. So the worker marks the config
it compiles with (`additional_config["probebus_taps"]`) before the compile, and tapped and
untapped models never share an entry. (On the CPU build 0.32 cannot load what it saved, taps
or not: "'function' object has no attribute 'finalize_loading'", and it compiles again at each
start; a tapped model loaded from that cache is therefore untested.) A compiled model that still runs none of the taps
(forwards ran, none staged a tensor) is refused at attach with an error saying so; so is an
engine whose CUDA graphs would replay the model without the outer model's Python (any
`cudagraph_mode` but NONE: the GPU build's default), and a compiled engine started without
the extension.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from collections.abc import Callable

import torch
from torch import nn

from .._hooks import tap
from .._sites import SiteKey, expand_sites
from ._arch import SiteView, VllmArch
from ._common import SITES_ENV

log = logging.getLogger("probebus")
TAG = "dormant-v1"  # in the worker's config hash: tapped compiled models get their own cache entries
_ATTR = "_probebus_dormant"  # the outer model's Dormant, in its __dict__
_watching: list = []  # [the extension class, the hook's handle] once `watch` ran


def watch(extension: type) -> None:
    """Tap, dormant, every vLLM model a worker of an engine started with `extension` (or a subclass of it) builds
    to compile (once per process). `probe/vllm/__init__.py` calls it with `WorkerExtension`."""
    if not _watching:
        _watching.extend([extension, torch.nn.modules.module.register_module_module_registration_hook(_on_submodule)])


def _on_submodule(module: nn.Module, name: str, value: object) -> None:
    """Runs at each `module.name = value` of a submodule, before it is set: the outer model's `model`, a class
    vLLM compiles (`support_torch_compile` gave it `do_not_compile`), is the moment to tap it."""
    if name != "model" or not hasattr(value, "do_not_compile") or _ATTR in module.__dict__:
        return
    config = sys.modules.get("vllm.config")
    cfg = config.get_current_vllm_config_or_none() if config is not None else None
    if cfg is None or not _extended(cfg.parallel_config.worker_extension_cls):
        return
    cc = cfg.compilation_config
    if int(cc.mode) == 0 or value.do_not_compile:  # eager: `attach` taps the model itself
        return
    graphs = getattr(cc.cudagraph_mode, "name", str(cc.cudagraph_mode))
    if graphs != "NONE":  # attach names the setting
        module.__dict__[_ATTR] = (f"compilation_config cudagraph_mode={graphs}: CUDA graphs replay the model without "
                                  "the Python that hands captures on; start the engine with "
                                  "compilation_config={'cudagraph_mode': 'NONE'}")
        return
    if isinstance(cfg.additional_config, dict):  # each set of taps compiles (and is cached) apart
        cfg.additional_config["probebus_taps"] = f"{TAG}:{os.environ.get(SITES_ENV, '').strip() or '*'}"
    module.__dict__[_ATTR] = Dormant(module, value)


def tapped_sites(arch: VllmArch) -> list[str]:
    """The local sites that get dormant taps: those `SITES_ENV` names in the engine's environment, or every one.
    A pattern that names no site raises (the worker's start fails with the reason, not a session later)."""
    spec = os.environ.get(SITES_ENV, "").strip()
    local = arch.local_sites()
    if not spec:
        return local
    chosen = set(expand_sites(SiteView(arch), [p.strip() for p in spec.split(",") if p.strip()]))
    return [s for s in local if s in chosen]


def _extended(path: str) -> bool:
    """Whether the engine's worker extension is ours (or a subclass): vLLM imported it before building the model."""
    module, _, name = path.rpartition(".")
    cls = getattr(sys.modules.get(module), name, None)
    return isinstance(cls, type) and issubclass(cls, _watching[0])


def dormant_of(model: nn.Module) -> Dormant | str | None:
    """The model's dormant taps; a text naming the setting that kept them out, and the fix; None: never tapped."""
    return model.__dict__.get(_ATTR)


class Dormant:
    """A worker's dormant taps: every site it computes stages its tensor each forward; `probe` (a `VllmProbe`,
    or None) decides at the step's end whether they are captured or dropped."""

    def __init__(self, outer: nn.Module, inner: nn.Module) -> None:
        self.staged: list[tuple[int, torch.Tensor]] = []
        self.probe: object = None
        self.forwards = 0  # forwards of the outer model since start-up
        self.staging = 0  # of which the compiled code staged tensors in
        self.warned = False
        # `outer.model` is set only after this hook returns: the arch reads the inner model from a stand-in.
        arch = VllmArch(types.SimpleNamespace(model=inner))  # type: ignore[arg-type]
        self.keys = [SiteKey.of(site) for site in tapped_sites(arch)]
        self.names = frozenset(key.name for key in self.keys)
        self.handles = [tap(outer, self._start, pre=True), tap(outer, self._end, pre=False)]
        self.handles += [arch.hook(key.name, _stager(self.staged, n)) for n, key in enumerate(self.keys)]

    def _start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.staged.clear()
        p = self.probe
        if p is not None:
            p._step_start(module, args, kwargs)  # type: ignore[attr-defined]

    def _end(self, module: nn.Module, args: tuple, output: object) -> None:
        staged, p = self.staged, self.probe
        self.forwards += 1
        self.staging += bool(staged)
        if p is not None:
            if not staged and not self.warned:  # the compiled code no longer runs the taps: say so, once
                self.warned = True
                log.warning("probebus: a forward of vLLM's compiled model ran none of probebus's taps: this "
                            "session captures nothing from it (was the model compiled again without them?)")
            keys, wanted = self.keys, p.wanted  # type: ignore[attr-defined]
            for n, t in staged:
                key = keys[n]
                if key.name in wanted:
                    p._capture(key, t)  # type: ignore[attr-defined]
            p._step_end(module, args, output)  # type: ignore[attr-defined]
        staged.clear()

    def check(self) -> None:
        """Raise when the compiled model has run forwards without running any tap (it was compiled without them)."""
        if self.forwards and not self.staging:
            raise RuntimeError("probebus: this engine's compiled model ran none of probebus's taps (it was compiled "
                               "without them, e.g. loaded from a compile cache written by another version); start "
                               "the engine with VLLM_DISABLE_COMPILE_CACHE=1, or with enforce_eager=True")


class Switch:
    """What a compiled-mode session holds instead of tap handles: `remove()` turns the dormant taps off."""

    def __init__(self, dormant: Dormant, probe: object) -> None:
        self.dormant = dormant
        dormant.probe = probe

    def remove(self) -> None:
        self.dormant.probe = None


def _stager(staged: list, n: int) -> Callable:
    def stage(key: SiteKey, t: torch.Tensor) -> None:
        staged.append((n, t))  # traced: a graph output and a side effect Dynamo replays after the graph
    return stage
