"""Issue 34 part 2: forward and backward read no tensor value on the host (a GPU synchronisation each),
counted on CPU with a dispatch mode over every block configuration; the data checks that did read
values run in debug mode only, and without it bad values come out NaN."""
import itertools
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import linattn
from linattn import LinearAttention, SoftmaxAttention, available_feature_maps
from linattn.attention import NORMALIZATIONS, ROPE_PLACEMENTS
from linattn.functional import linear_attention, linear_attention_step
from linattn.ops.linear_attention import torch_logspace
from linattn.ops.linear_attention.cpp_logspace import unavailable

HOST_READS = (torch.ops.aten._local_scalar_dense, torch.ops.aten.is_nonzero, torch.ops.aten.item)
# The torch backend's causal log-space pass decides from the data which chunks take its exact path
# (torch_logspace.py, 6. of its docstring): those decisions read the data, once or twice per
# run of chunks; they are the only reads left, and they are not checks (the C++ kernel takes the same
# decisions inside its loop, the fla route inside fla's kernels).
ALGORITHM = torch_logspace.__file__


class HostReads(TorchDispatchMode):
    """Records where each op that reads a tensor value on the host was called from."""

    def __init__(self):
        super().__init__()
        self.sites = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in HOST_READS:
            self.sites.append({frame.filename for frame in traceback.extract_stack()})
        return func(*args, **(kwargs or {}))


def reads_of_forward_and_backward(block) -> list:
    x = torch.randn(2, 20, 32, requires_grad=True)
    with HostReads() as reads:
        block(x).square().sum().backward()
    return reads.sites


BACKENDS = ["torch", pytest.param("cpp", marks=pytest.mark.skipif(unavailable() is not None, reason="no cpp"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", available_feature_maps())
def test_no_linear_block_reads_a_value_on_forward_or_backward(name, backend):
    for rope, normalization, causal in itertools.product(ROPE_PLACEMENTS, NORMALIZATIONS, (True, False)):
        block = LinearAttention(32, 2, feature_map=name, rope=rope, normalization=normalization, causal=causal,
                                backend=backend, chunk_size=8)
        sites = reads_of_forward_and_backward(block)
        if backend == "torch" and causal and block.feature_map.log_space:
            assert all(ALGORITHM in site for site in sites), (rope, normalization)
            assert len(sites) <= 6, (rope, normalization, len(sites))   # 3 chunks: one run, one irregular chunk
        else:
            assert sites == [], (rope, normalization, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_the_softmax_block_reads_no_value(causal):
    assert reads_of_forward_and_backward(SoftmaxAttention(32, 2, causal=causal)) == []


def test_a_decoding_step_reads_no_value():
    block = LinearAttention(32, 2).eval()
    state = block(torch.randn(1, 4, 32), return_state=True)[1]
    with HostReads() as reads, torch.no_grad():
        block.step(torch.randn(1, 32), state)
    assert reads.sites == []


@pytest.fixture
def debug():
    linattn.set_debug(True)
    yield
    linattn.set_debug(False)


def test_debug_mode_is_off_by_default_and_takes_only_bools():
    from linattn.checks import debug_enabled
    assert not debug_enabled()
    with pytest.raises(ValueError, match="enabled"):
        linattn.set_debug("yes")


def test_negative_features_give_nan_rows_or_in_debug_mode_an_error(debug):
    phi = torch.rand(1, 1, 6, 4)
    phi[0, 0, 3, 1] = -0.5
    v = torch.randn(1, 1, 6, 4)
    with pytest.raises(ValueError, match="negative"):
        linear_attention(phi, phi.abs(), v, causal=True, rotary=False)
    linattn.set_debug(False)
    out = linear_attention(phi, phi.abs(), v, causal=True, rotary=False)
    assert out[..., 3:, :].isnan().all()   # (earlier rows of its chunk too: 0 * NaN in the chunk's product)


@pytest.mark.parametrize("projected", [False, True])
def test_log_features_beyond_the_bound_give_nan_rows_or_in_debug_mode_an_error(debug, projected):
    from linattn.functional import LogProjection
    x, weight, v = torch.randn(1, 1, 8, 4), torch.randn(6, 4), torch.randn(1, 1, 8, 4)
    x[0, 0, 5] = 5e3                              # |x|^2 / 8 = 1.25e7 > 8.4e6
    keys = LogProjection(x, weight, 0.0, -1 / 8) if projected else LogProjection(x, weight, 0.0, -1 / 8).materialize()
    queries = torch.randn(1, 1, 8, 6)
    with pytest.raises(ValueError, match="log-features reach"):
        linear_attention(queries, keys, v, causal=True, rotary=True, log_space=True, backend="torch")
    linattn.set_debug(False)
    out = linear_attention(queries, keys, v, causal=True, rotary=True, log_space=True, backend="torch")
    assert out[..., :5, :].isfinite().all() and out[..., 5:, :].isnan().all()


def test_a_damaged_decoding_state_is_refused_in_debug_mode(debug):
    block = LinearAttention(32, 2).eval()
    state = block(torch.randn(1, 4, 32), return_state=True)[1]
    state.kv[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        block.step(torch.randn(1, 32), state)


def test_a_step_with_negative_features_gives_nan(debug):
    phi, v = torch.rand(1, 1, 4), torch.randn(1, 1, 4)
    with pytest.raises(ValueError, match="negative"):
        linear_attention_step(-phi, phi, v, None, rotary=False)
    linattn.set_debug(False)
    assert linear_attention_step(-phi, phi, v, None, rotary=False)[0].isnan().all()
