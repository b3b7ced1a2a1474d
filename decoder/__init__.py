"""decoder: speculative decoding as a subscriber of the probe bus.

    import decoder
    drafter = decoder.load_drafter("default", target=model)          # the drafter shipped next to the model
    with decoder.SpeculativeDecoder(model, "auto", model_drafter=drafter) as spec:
        out = spec.generate(input_ids, max_new_tokens=64)              # == greedy generate, faster
    print(out.stats.tau, out.stats.tokens_per_forward)

The sub-packages say the architecture, each importing only those below it:
    loop/       the decoder: a call, its rounds (plan -> draft -> verify -> commit -> account), trees, plain paths
    drafters/   the model drafters (EAGLE-3, Medusa, MTP, DSpark, draft model, layer skip, remote) and n-gram lookup
    training/   training the drafters from recorded features
    schedule/   the round scheduler and the measured cost model
    forward/    how the loop runs the target's forward: its KV cache, packed weights, masks
    verify.py   every accept/reject rule (greedy, sampled; chains, trees)
This top level holds what the README and the examples use. `decoder` imports `probe` (and `exporters` for
training), never `probebus`.
"""

from .drafters import (
    DRAFTER_NAMES,
    DrafterError,
    NgramDrafter,
    RemoteEagle,
    default_aux_layers,
    load_drafter,
    load_named_drafter,
    serve_drafter,
    tree_nodes,
)
from .loop import SpecOutput, SpecStats, SpeculativeDecoder
from .training import TrainConfig, train_drafter

__all__ = [
    "default_aux_layers", "DRAFTER_NAMES", "DrafterError", "load_drafter", "load_named_drafter", "NgramDrafter",
    "RemoteEagle", "serve_drafter", "SpecOutput", "SpecStats", "SpeculativeDecoder", "TrainConfig", "train_drafter",
    "tree_nodes",
]
