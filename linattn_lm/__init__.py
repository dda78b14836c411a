"""Byte-level language models on linattn's attention blocks, plus the checkpoint and runtime helpers
that train.py, grid.py and eval.py share."""
from .checkpoint import (CHECKPOINT_NAME, CheckpointError, checkpoint_path, config_differences,
                         load_checkpoint, model_from_checkpoint, save_checkpoint)
from .lm import ByteLM, DecodeState, ModelConfig, bits_per_byte, favor_layer_seed, lm_loss

__all__ = [
    "CHECKPOINT_NAME", "ByteLM", "CheckpointError", "DecodeState", "ModelConfig", "bits_per_byte",
    "checkpoint_path", "config_differences", "favor_layer_seed", "lm_loss", "load_checkpoint",
    "model_from_checkpoint", "save_checkpoint",
]
