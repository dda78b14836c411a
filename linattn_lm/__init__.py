"""The byte-level language-model harness on linattn's attention blocks: the model, its settings,
checkpoints, the enwik8 loader, and the training, grid and evaluation commands (train.py, grid.py
and eval.py are thin wrappers around `training.main`, `grid.main` and `evaluate.main`)."""
from .checkpoint import (CHECKPOINT_NAME, CheckpointError, checkpoint_path, load_checkpoint, model_from_checkpoint,
                         save_checkpoint)
from .flags import config_from_flags
from .presets import PRESETS
from .settings import LogConfig, OptimConfig, RunConfig, TrainConfig
from .lm import ByteLM, DecodeState, ModelConfig, bits_per_byte, layer_seed, lm_loss

__all__ = [
    "CHECKPOINT_NAME", "ByteLM", "CheckpointError", "DecodeState", "LogConfig", "ModelConfig", "OptimConfig",
    "PRESETS", "RunConfig", "TrainConfig", "bits_per_byte", "checkpoint_path", "config_from_flags",
    "layer_seed", "lm_loss", "load_checkpoint", "model_from_checkpoint", "save_checkpoint",
]
