"""Text to byte ids and back, and the text samples a run logs."""
from __future__ import annotations

import numpy as np
import torch

from .device import autocast
from .lm import ByteLM
from .settings import TrainConfig

SAMPLE_PROMPT_BYTES = 128
SAMPLE_NEW_BYTES = 256


def decode_bytes(ids: torch.Tensor) -> str:
    """Byte ids -> text; invalid UTF-8 (a sample cut mid-character) shows as U+FFFD."""
    return bytes(ids.tolist()).decode("utf-8", errors="replace")


def encode_text(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def sample_prompt(val: np.ndarray, config: TrainConfig) -> tuple[torch.Tensor, int]:
    """The first bytes of val as a prompt, and how many bytes to sample after it (learned absolute
    positions cannot go past seq_len)."""
    seq_len = config.model.seq_len
    prompt_len = max(1, min(SAMPLE_PROMPT_BYTES, seq_len // 2))
    new_bytes = seq_len - prompt_len + 1 if config.model.abs_pos else SAMPLE_NEW_BYTES
    return torch.from_numpy(val[:prompt_len].astype(np.int64)), min(new_bytes, SAMPLE_NEW_BYTES)


def text_sample(model: ByteLM, prompt: torch.Tensor, new_bytes: int, seed: int, device: torch.device,
                dtype: str = "auto") -> str:
    generator = torch.Generator(device).manual_seed(seed)
    with autocast(device, dtype):
        new = model.generate(prompt.to(device), new_bytes, temperature=1.0, generator=generator)
    indent = lambda text: "    " + text.replace("\n", "\n    ")   # markdown code block, any content
    return f"prompt:\n\n{indent(decode_bytes(prompt))}\n\nsample:\n\n{indent(decode_bytes(new))}"
