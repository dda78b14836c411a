"""The library checks its arguments once, where a user calls it: a block's forward and step run a few
check calls, not the same checks again in every layer below (issue 35)."""
import collections
import os
import re
import sys

import pytest
import torch

import linattn

ROOT = os.path.dirname(linattn.__file__)
CHECK = re.compile(r"^_?check_\w+$|^is_\w+$")


def check_calls(run) -> collections.Counter:
    """The calls of check_* / _check_* / is_* functions defined in linattn/ while run() runs."""
    calls = collections.Counter()

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(ROOT) and CHECK.match(code.co_name):
            calls[code.co_name] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("options, step_bound", [
    (dict(), 8), (dict(feature_map="elu"), 8), (dict(feature_map="taylor", rope="pre"), 8),
    # its state holds a linear state too, checked as a plain step checks it (issue 49)
    (dict(window=2, decay="retnet"), 11),
], ids=["favor", "elu", "taylor", "window"])
def test_forward_and_step_check_their_arguments_a_few_times_only(options, step_bound):
    """Before: 41 check calls per forward of the default block and 56 per step."""
    block = linattn.LinearAttention(16, 2, backend="torch", **options)
    x = torch.randn(1, 5, 16)
    _, state = block(x, return_state=True)
    forward, step = check_calls(lambda: block(x)), check_calls(lambda: block.step(x[:, 0], state))
    assert sum(forward.values()) <= 10, forward
    assert sum(step.values()) <= step_bound, step
