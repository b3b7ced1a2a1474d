"""Training the drafters from features recorded off the probe bus (`exporters`' Arrow files).

    from decoder.training import TrainConfig, train_drafter, train_medusa
"""

from ._confidence_train import train_confidence
from ._train import TrainConfig, heldout_acceptance, load_sequences, load_site_sequences, train_drafter, ttt_mask
from ._train_heads import (
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

__all__ = [
    "dspark_acceptance", "DSparkTrainConfig", "heads_acceptance", "HeadsTrainConfig", "heldout_acceptance",
    "kmeans_clusters", "load_sequences", "load_site_sequences", "mtp_acceptance", "MTPTrainConfig", "train_confidence",
    "train_drafter", "train_dspark", "train_medusa", "train_mtp", "TrainConfig", "ttt_mask",
]
