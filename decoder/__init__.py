"""decoder: speculative decoding as a subscriber of the probe bus.

    from decoder import SpeculativeDecoder, load_drafter, NgramDrafter
    drafter = load_drafter("probebus/models/default-drafter", target=model)
    with SpeculativeDecoder(model, drafter, k=5) as spec:
        out = spec.generate(input_ids, max_new_tokens=64)      # == greedy generate, faster
    print(out.stats.tau, out.stats.tokens_per_forward)
"""

from ._checkpoint import DrafterError, check_against_target, load_drafter, save_drafter
from ._eagle import DraftCache, Eagle3Config, Eagle3Drafter, default_aux_layers
from ._feeder import EagleFeeder
from ._loop import SpecOutput, SpecStats, SpeculativeDecoder
from ._ngram import NgramDrafter
from ._remote import RemoteEagle, serve_drafter
from ._verify import accept, target_probs, verify_greedy, verify_sampling

__all__ = [
    "DraftCache", "DrafterError", "EagleFeeder", "RemoteEagle", "serve_drafter",
    "Eagle3Config", "Eagle3Drafter", "NgramDrafter", "SpecOutput", "SpecStats",
    "SpeculativeDecoder", "accept", "check_against_target", "default_aux_layers", "load_drafter", "save_drafter",
    "target_probs", "verify_greedy", "verify_sampling",
]

from ._train import TrainConfig, load_sequences, train_drafter, ttt_mask  # noqa: E402

__all__ += ["TrainConfig", "load_sequences", "train_drafter", "ttt_mask"]
