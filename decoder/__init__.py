"""decoder: speculative decoding as a subscriber of the probe bus.

    from decoder import SpeculativeDecoder, load_drafter
    drafter = load_drafter("default", target=model)            # the drafter shipped next to the model
    with SpeculativeDecoder(model, "auto", eagle=drafter, k=5) as spec:
        out = spec.generate(input_ids, max_new_tokens=64)      # == greedy generate, faster
    print(out.stats.tau, out.stats.tokens_per_forward)

`decoder` imports `probe` (and `exporters` for training), never `probebus`.
"""

from .drafters._checkpoint import DrafterError, check_against_target, load_drafter, resolve_drafter_path, save_drafter
from .drafters._confidence import ConfidenceHead
from .drafters._draft_model import DraftModelDrafter, LayerSkipDrafter, early_exit_view
from .drafters._dspark import DSparkConfig, DSparkFeeder, DSparkHead, load_dspark, save_dspark
from .drafters._eagle import DraftCache, Eagle3Config, Eagle3Drafter, default_aux_layers
from .drafters._feeder import Drafts, EagleFeeder, Feeder
from .drafters._layer_skip import exit_acceptance, fit_layer_skip, load_layer_skip
from .drafters._medusa import MedusaConfig, MedusaFeeder, MedusaHeads, load_medusa, save_medusa
from .drafters._mtp import MTPConfig, MTPFeeder, MTPHead, load_mtp, save_mtp
from .drafters._mtp_attn import MTPAttnDrafter, save_mtp_attn
from .drafters._named import NAMES as DRAFTER_NAMES
from .drafters._named import load_named_drafter, tree_nodes
from .drafters._ngram import NgramDrafter, NgramIndex
from .drafters._remote import RemoteEagle, serve_drafter
from .loop._decoder import SpecOutput, SpecStats, SpeculativeDecoder
from .loop._oracle import OracleResult, oracle_bound, simulated_seconds
from .loop._plot import plot_stats
from .schedule._cost import CostModel
from .schedule._sched import DraftPlan, Scheduler
from .training._confidence_train import train_confidence
from .training._train import (
    TrainConfig,
    heldout_acceptance,
    load_sequences,
    load_site_sequences,
    train_drafter,
    ttt_mask,
)
from .training._train_heads import (
    DSparkTrainConfig,
    HeadsTrainConfig,
    MTPTrainConfig,
    dspark_acceptance,
    heads_acceptance,
    kmeans_clusters,
    mtp_acceptance,
    train_dspark,
    train_medusa,
    train_mtp,
)
from .verify import accept, target_probs, verify_greedy, verify_greedy_rows, verify_rows, verify_sampling

__all__ = [
    "accept", "check_against_target", "ConfidenceHead", "CostModel", "default_aux_layers", "DraftCache",
    "DRAFTER_NAMES", "DrafterError", "DraftModelDrafter", "DraftPlan", "Drafts", "dspark_acceptance", "DSparkConfig",
    "DSparkFeeder", "DSparkHead", "DSparkTrainConfig", "Eagle3Config", "Eagle3Drafter", "EagleFeeder",
    "early_exit_view", "exit_acceptance", "Feeder", "fit_layer_skip", "heads_acceptance", "HeadsTrainConfig",
    "heldout_acceptance", "kmeans_clusters", "LayerSkipDrafter", "load_drafter", "load_dspark", "load_layer_skip",
    "load_medusa", "load_mtp", "load_named_drafter", "load_sequences", "load_site_sequences", "MedusaConfig",
    "MedusaFeeder", "MedusaHeads", "mtp_acceptance", "MTPAttnDrafter", "MTPConfig", "MTPFeeder", "MTPHead",
    "MTPTrainConfig", "NgramDrafter", "NgramIndex", "oracle_bound", "OracleResult", "plot_stats", "RemoteEagle",
    "resolve_drafter_path", "save_drafter", "save_dspark", "save_medusa", "save_mtp", "save_mtp_attn", "Scheduler",
    "serve_drafter", "simulated_seconds", "SpecOutput", "SpecStats", "SpeculativeDecoder", "target_probs",
    "train_confidence", "train_drafter", "train_dspark", "train_medusa", "train_mtp", "TrainConfig", "tree_nodes",
    "ttt_mask", "verify_greedy", "verify_greedy_rows", "verify_rows", "verify_sampling",
]
