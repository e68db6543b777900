"""Sparse autoencoders on stored activations: models, training, checkpoints, inference.

Example:
    >>> from actstore.runs import Run
    >>> from actstore.sae import TrainConfig, train_run, infer_run
    >>> run = Run("runs/k3x9q2ab")  # doctest: +SKIP
    >>> train_run(run, TrainConfig(kind="topk", k=32))  # doctest: +SKIP
    >>> infer_run(run, "val")  # doctest: +SKIP
"""

from .checkpoint import load_sae, save_sae
from .inference import InferenceConfig, encode_store, infer_run, load_inference
from .model import SAEConfig, SparseAutoencoder
from .sparse import SparseActs
from .train import TrainConfig, TrainResult, evaluate, train_run, train_sae

__all__ = [
    "InferenceConfig",
    "SAEConfig",
    "SparseActs",
    "SparseAutoencoder",
    "TrainConfig",
    "TrainResult",
    "encode_store",
    "evaluate",
    "infer_run",
    "load_inference",
    "load_sae",
    "save_sae",
    "train_run",
    "train_sae",
]
