"""decoder: speculative decoding as a subscriber of the probe bus.

    from decoder import SpeculativeDecoder, load_drafter
    drafter = load_drafter("default", target=model)            # the drafter shipped next to the model
    with SpeculativeDecoder(model, "auto", eagle=drafter, k=5) as spec:
        out = spec.generate(input_ids, max_new_tokens=64)      # == greedy generate, faster
    print(out.stats.tau, out.stats.tokens_per_forward)

`decoder` imports `probe` (and `exporters` for training), never `probebus`.
"""

from ._checkpoint import DrafterError, check_against_target, load_drafter, resolve_drafter_path, save_drafter
from ._confidence import ConfidenceHead, train_confidence
from ._cost import CostModel
from ._draft_model import DraftModelDrafter, LayerSkipDrafter, early_exit_view
from ._eagle import DraftCache, Eagle3Config, Eagle3Drafter, default_aux_layers
from ._feeder import Drafts, EagleFeeder, Feeder
from ._layer_skip import exit_acceptance, fit_layer_skip, load_layer_skip
from ._loop import SpecOutput, SpecStats, SpeculativeDecoder
from ._medusa import MedusaConfig, MedusaFeeder, MedusaHeads, load_medusa, save_medusa
from ._mtp import MTPConfig, MTPFeeder, MTPHead, load_mtp, save_mtp
from ._named import NAMES as DRAFTER_NAMES
from ._named import load_named_drafter, tree_nodes
from ._ngram import NgramDrafter, NgramIndex
from ._oracle import OracleResult, oracle_bound, simulated_seconds
from ._plot import plot_stats
from ._remote import RemoteEagle, serve_drafter
from ._sched import DraftPlan, Scheduler
from ._train import TrainConfig, heldout_acceptance, load_sequences, load_site_sequences, train_drafter, ttt_mask
from ._train_heads import (
    HeadsTrainConfig,
    MTPTrainConfig,
    heads_acceptance,
    kmeans_clusters,
    mtp_acceptance,
    train_medusa,
    train_mtp,
)
from ._verify import accept, target_probs, verify_greedy, verify_greedy_rows, verify_rows, verify_sampling

__all__ = [
    "DraftModelDrafter", "HeadsTrainConfig", "LayerSkipDrafter", "MedusaConfig", "MedusaFeeder", "MedusaHeads",
    "DRAFTER_NAMES", "exit_acceptance", "fit_layer_skip", "load_layer_skip", "load_named_drafter", "tree_nodes",
    "early_exit_view", "MTPConfig", "MTPFeeder", "MTPHead", "MTPTrainConfig", "kmeans_clusters", "load_mtp",
    "mtp_acceptance", "save_mtp", "train_mtp", "heads_acceptance", "load_medusa", "load_site_sequences",
    "save_medusa", "train_medusa",
    "ConfidenceHead", "CostModel", "DraftCache", "DraftPlan", "DrafterError", "Drafts", "Eagle3Config",
    "Eagle3Drafter", "EagleFeeder", "Feeder", "NgramDrafter", "NgramIndex", "OracleResult", "RemoteEagle", "Scheduler",
    "SpecOutput", "SpecStats", "SpeculativeDecoder", "TrainConfig", "accept", "check_against_target",
    "default_aux_layers", "heldout_acceptance", "load_drafter", "load_sequences", "oracle_bound", "plot_stats",
    "resolve_drafter_path", "simulated_seconds",
    "save_drafter", "serve_drafter", "target_probs", "train_confidence", "train_drafter", "ttt_mask",
    "verify_greedy", "verify_greedy_rows", "verify_rows", "verify_sampling",
]
