"""Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors.  It must be switched
on before the kernel module is imported, which happens lazily at the first triton call."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
