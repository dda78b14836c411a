"""Text to byte ids and back, for prompts and samples."""
from __future__ import annotations

import torch


def decode_bytes(ids: torch.Tensor) -> str:
    """Byte ids -> text; invalid UTF-8 (a sample cut mid-character) shows as U+FFFD."""
    return bytes(ids.tolist()).decode("utf-8", errors="replace")


def encode_text(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
