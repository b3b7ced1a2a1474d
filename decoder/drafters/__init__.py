"""The drafters: model drafters that read the target's features off the probe bus (EAGLE-3, Medusa, MTP, DSpark),
or its tokens (a draft model, layer skip), in this process or another (`RemoteEagle`), and n-gram lookup.

    from decoder.drafters import load_named_drafter, MedusaFeeder, NgramDrafter
"""

from ._checkpoint import DrafterError, check_against_target, load_drafter, resolve_drafter_path, save_drafter
from ._confidence import ConfidenceHead
from ._draft_model import DraftModelDrafter, LayerSkipDrafter, early_exit_view
from ._dspark import DSparkConfig, DSparkFeeder, DSparkHead, load_dspark, save_dspark
from ._eagle import DraftCache, Eagle3Config, Eagle3Drafter, default_aux_layers
from ._feeder import Drafts, EagleFeeder, Feeder, feature_sites
from ._layer_skip import exit_acceptance, fit_layer_skip, load_layer_skip
from ._medusa import MedusaConfig, MedusaFeeder, MedusaHeads, load_medusa, save_medusa
from ._mtp import MTPConfig, MTPFeeder, MTPHead, load_mtp, save_mtp
from ._mtp_attn import MTPAttnDrafter, save_mtp_attn
from ._named import NAMES as DRAFTER_NAMES
from ._named import load_named_drafter, tree_nodes
from ._ngram import NgramDrafter, NgramIndex
from ._remote import RemoteEagle, serve_drafter
from ._tree import Tree, eagle_tree, keep_path, medusa_tree, tree_attention
from ._tree_sample import eagle_tree_sampled, grow_sampled, medusa_tree_sampled

__all__ = [
    "check_against_target", "ConfidenceHead", "default_aux_layers", "DraftCache", "DRAFTER_NAMES", "DrafterError",
    "DraftModelDrafter", "Drafts", "DSparkConfig", "DSparkFeeder", "DSparkHead", "Eagle3Config", "Eagle3Drafter",
    "EagleFeeder", "early_exit_view", "exit_acceptance", "feature_sites", "Feeder", "fit_layer_skip",
    "LayerSkipDrafter", "load_drafter", "load_dspark", "load_layer_skip", "load_medusa", "load_mtp",
    "load_named_drafter", "MedusaConfig", "MedusaFeeder", "MedusaHeads", "MTPAttnDrafter", "MTPConfig", "MTPFeeder",
    "MTPHead", "NgramDrafter", "NgramIndex", "RemoteEagle", "resolve_drafter_path", "save_drafter", "save_dspark",
    "save_medusa", "save_mtp", "save_mtp_attn", "serve_drafter", "Tree", "tree_nodes", "eagle_tree", "keep_path",
    "medusa_tree", "tree_attention", "eagle_tree_sampled", "grow_sampled", "medusa_tree_sampled",
]
