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
from linattn.ops.linear_attention.cpp_logspace import unavailable

# (nonzero's output shape is the data's: on a GPU it synchronises as a value read does; equal answers a bool)
HOST_READS = (torch.ops.aten._local_scalar_dense, torch.ops.aten.is_nonzero, torch.ops.aten.item,
              torch.ops.aten.nonzero, torch.ops.aten.equal)
BLOCK_OPTIONS = ({}, {"window": 4}, {"decay": "retnet"}, {"window": 4, "decay": "retnet"}, {"short_conv": 3})


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
    for rope, normalization, causal, options in itertools.product(ROPE_PLACEMENTS, NORMALIZATIONS, (True, False),
                                                                  BLOCK_OPTIONS):
        if not causal and options:   # window, decay and the convolution are causal attention's options
            continue
        block = LinearAttention(32, 2, feature_map=name, rope=rope, normalization=normalization, causal=causal,
                                backend=backend, chunk_size=8, **options)
        assert reads_of_forward_and_backward(block) == [], (rope, normalization, causal, options)


@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 5, 8, 64])
def test_the_torch_log_space_pass_reads_no_value_where_maxima_jump_inside_chunks(rotary, chunk_size):
    """Keys whose running maxima jump far past JUMP_LIMIT inside chunks and pairs whose scales spread past
    PAIR_SPREAD (what the torch pass once decided on the host), from log-feature tensors and a projection."""
    from linattn.functional import LogProjection
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 21, 4, generator=generator)
    weight = torch.randn(8, 4, generator=generator).requires_grad_()
    b = (torch.randn(1, 2, 21, 8, generator=generator) * 100).requires_grad_()
    jumps = torch.arange(21.0).mul(45).view(21, 1).expand(1, 2, 21, 1)
    a = torch.randn(1, 2, 21, 8, generator=generator) * 100 + jumps
    a[..., 1::2] += 25
    v = torch.randn(1, 2, 21, 3, generator=generator, requires_grad=True)
    for keys in (a.requires_grad_(), LogProjection(x * 30, weight, jumps, -0.5)):
        with HostReads() as reads:
            out = linear_attention(b, keys, v, causal=True, rotary=rotary, log_space=True, backend="torch",
                                   chunk_size=chunk_size)
            out.square().sum().backward()
        assert out.isfinite().all() and reads.sites == []


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


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"window": 64}, {"decay": "retnet"}])
@pytest.mark.parametrize("name", ["favor", "elu"])
def test_gpu_the_fla_route_never_waits_for_the_device(name, options):
    """What the dispatch mode above cannot see: a copy from host memory (torch.tensor(..., device=cuda))
    makes the host wait too.  CUDA's sync debug mode raises on any synchronisation, in forward + backward
    of the block in bf16 (after a first call, which may build its caches)."""
    block = LinearAttention(512, 8, feature_map=name, rope="post", backend="fla", **options).cuda()
    x = torch.randn(2, 1024, 512, device="cuda", requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            block(x).float().square().mean().backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
