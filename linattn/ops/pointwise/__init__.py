"""Plain feature maps given by one formula per input entry, queries and keys alike (elu + 1): naive.py,
the formulas in torch (the maps' forward, the reference); kernels.py, each formula and the cast to fla's
dtype in one Triton kernel per direction, as custom ops (the fla route's features).  Only naive.py is
imported here: kernels.py needs triton, a GPU dependency."""
from .naive import POINTWISE, elu_plus_one

__all__ = ["POINTWISE", "elu_plus_one"]
