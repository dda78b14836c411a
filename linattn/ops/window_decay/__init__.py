"""Gap-closers inside causal linear attention: a sliding window of exact softmax and a per-head decay
(docs/gap-closers.md).  band.py: the window's exact softmax in O(N W), with each row's log-normaliser;
window.py: the parallel pass and the one-token step; naive.py: the explicit
N x N definition they are tested against.  The linear part runs the op of ops/linear_attention."""
from .band import band_attention, merge
from .naive import window_decay_reference
from .window import WindowState, retnet_decay, window_decay_attention, window_decay_step

__all__ = ["WindowState", "band_attention", "merge", "retnet_decay", "window_decay_attention", "window_decay_reference", "window_decay_step"]
