"""Devices and memory (linattn_lm/device.py)."""
import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset")
def test_each_run_measures_its_own_peak_after_earlier_ones_freed_memory():
    """keep_freed_memory() keeps freed heap resident; a grid's next run first hands it back, so
    its peak is not the earlier runs' (it was 512, 629, 634 MB for three identical runs)."""
    code = ("import torch\n"
            "from linattn_lm.device import keep_freed_memory, peak_memory_mb, release_free_memory, "
            "reset_peak_memory\n"
            "cpu = torch.device('cpu')\n"
            "keep_freed_memory()\n"
            "before = peak_memory_mb(cpu)\n"
            "x = torch.ones(2 ** 26)\n"       # 256 MiB
            "del x\n"
            "release_free_memory()\n"
            "reset_peak_memory(cpu)\n"
            "print(peak_memory_mb(cpu) - before)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(result.stdout) < 64, result.stdout
