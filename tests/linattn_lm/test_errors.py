"""How a command reports failure (linattn_lm/errors.py), through training's run_reporting_errors."""
import pytest
import torch

from linattn_lm.errors import EXIT_ERROR
from linattn_lm.training import run_reporting_errors


@pytest.mark.parametrize("error", [RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't "
                                                "allocate memory: you tried to allocate 83072000000 bytes"),
                                   MemoryError(), torch.OutOfMemoryError("CUDA out of memory")])
def test_running_out_of_memory_on_any_device_is_one_line(error, capsys):
    """On CPU torch reports a failed allocation as a plain RuntimeError, which gave a traceback."""
    def run():
        raise error
    assert run_reporting_errors(run) == EXIT_ERROR
    assert capsys.readouterr().err == "error: out of memory: choose a smaller --batch-size, --seq-len or model\n"


def test_other_runtime_errors_keep_their_traceback():
    def run():
        raise RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_reporting_errors(run)
