"""The log-space op's decay inside its chunks (`linear_attention(..., log_decay=)`): outputs, log-normalisers,
states and gradients against the float64 reference on both CPU backends (rotary on and off, key offsets, chunks
that divide N and that do not, log-features and FAVOR+'s projection, irregular chunks), gradcheck, decoding
equal to the parallel pass, exactness far into a sequence (where the fold it replaced was not; on the fla
route too, its glue and its own kernels), the custom op (its compiled run: test_functional_log_normalizer.py),
and bad input.  The fla route's other decay tests: test_fla_kernels.py."""
import math
import os
from functools import partial

import pytest
import torch

from linattn import functional
from linattn.custom_ops import linear_attention_op
from linattn.ops.linear_attention import dispatch, fla_kernels
from linattn.ops.linear_attention.common import LogProjection
from linattn.ops.linear_attention.naive import logspace_attention_reference
from linattn.ops.linear_attention.stable import numerator_scale
from linattn.rotary import rotate

LOG_DECAY = torch.tensor([-0.05, -0.7], dtype=torch.float64)   # (H,): mild, and strong (2.8 per chunk of 4)
OFFSETS = [(0, None), (6, 2), (3, 9)]     # (queries' offset, key_offset): the same, keys behind, keys ahead
N = 20


def leaves(seed: int, n: int = N, scale: float = 1.0, projected: bool = False):
    """(b or its projection's inputs, a or its inputs, v), float64; where `projected`, with a weight and shifts."""
    generator = torch.Generator().manual_seed(seed)
    width = 5 if projected else 6
    tensors = [torch.randn(1, 2, n, size, generator=generator, dtype=torch.float64) * s
               for size, s in ((width, scale), (width, scale), (3, 1.0))]
    if not projected:
        return tensors, None
    extra = [torch.randn(6, width, generator=generator, dtype=torch.float64) * 0.5,
             torch.randn(1, 2, n, 1, generator=generator, dtype=torch.float64)]
    return tensors + extra, extra


def as_features(tensors, projected: bool):
    """The op's (b, a, v) from `leaves`: tensors, or FAVOR+-like LogProjections sharing the weight."""
    if not projected:
        return tensors
    q, k, v, weight, shift = tensors
    return LogProjection(q, weight, shift, -0.1), LogProjection(k, weight, -0.3, -0.1), v


def materialized(x):
    return x.materialize() if isinstance(x, LogProjection) else x


def reference_state(a, v, *, rotary: bool, key_offset: int, log_decay):
    """sum_n gamma^(N - n) R_n e^(a_n) v_n^T and sum_n gamma^(N - n) e^(a_n): the state after N keys, as the
    next position sees them."""
    n = a.shape[-2]
    weights = torch.exp(a + ((n - torch.arange(n, dtype=a.dtype)) * log_decay[:, None])[:, :, None])
    rotated = rotate(weights, offset=key_offset) if rotary else weights
    return rotated.transpose(-1, -2) @ v, weights.sum(-2)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("chunk_size", [4, 6])      # divides N = 20, and does not
@pytest.mark.parametrize("offset,key_offset", OFFSETS)
@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("projected", [False, True])
def test_outputs_log_normalizers_states_and_gradients_match_the_reference(projected, rotary, offset, key_offset,
                                                                          chunk_size, backend):
    tensors, _ = leaves(1, projected=projected)
    inputs = [t.clone().requires_grad_() for t in tensors]
    expected = [t.clone().requires_grad_() for t in tensors]
    out, state, lse = functional.linear_attention(*as_features(inputs, projected), causal=True, rotary=rotary,
                                                  offset=offset, key_offset=key_offset, chunk_size=chunk_size,
                                                  backend=backend, log_space=True, return_state=True,
                                                  return_log_normalizer=True, log_decay=LOG_DECAY)
    b, a, v = (materialized(x) for x in as_features(expected, projected))
    ref, ref_lse = logspace_attention_reference(b, a, v, causal=True, rotary=rotary, offset=offset,
                                                key_offset=key_offset, return_log_normalizer=True, log_decay=LOG_DECAY)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-9, atol=1e-11)
    keys_at = offset if key_offset is None else key_offset
    assert state.position == keys_at + N
    kv, k_sum = reference_state(a.detach(), v.detach(), rotary=rotary, key_offset=keys_at, log_decay=LOG_DECAY)
    pair = numerator_scale(state.log_scale, rotary)
    torch.testing.assert_close(state.kv * pair.exp().unsqueeze(-1), kv, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(state.k_sum * state.log_scale.exp(), k_sum, rtol=1e-9, atol=1e-11)
    generator = torch.Generator().manual_seed(2)
    weights = [torch.randn(t.shape, generator=generator, dtype=torch.float64) for t in (out, lse)]

    def loss(*results):
        return sum((t * w).sum() for t, w in zip(results, weights))
    grads = torch.autograd.grad(loss(out, lse), inputs)
    for got, want in zip(grads, torch.autograd.grad(loss(ref, ref_lse), expected)):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("log_decay", [[-0.05, -0.7], [-9.0, 0.0]])   # [-9, 0]: every chunk's keys jump past 30
def test_irregular_chunks_match_the_reference(log_decay, rotary, backend):
    """Scale 40: keys whose maxima jump past JUMP_LIMIT and wide pairs (the chunks the C++ kernel hands back),
    and a decay that alone moves a chunk's keys by 27 (9 x 3 rows) in its frame.  The queries' two coordinates
    of a pair stay close, so that Eq. 19's numerator stays below its cap."""
    tensors, _ = leaves(3, n=21, scale=40.0)
    pairs = tensors[0].unflatten(-1, (-1, 2))
    tensors[0] = (pairs.mean(-1, keepdim=True) + 0.005 * pairs).flatten(-2)
    rate = torch.tensor(log_decay, dtype=torch.float64)
    inputs = [t.clone().requires_grad_() for t in tensors]
    expected = [t.clone().requires_grad_() for t in tensors]
    out, lse = functional.linear_attention(*inputs, causal=True, rotary=rotary, offset=5, key_offset=1, chunk_size=4,
                                           backend=backend, log_space=True, return_log_normalizer=True,
                                           log_decay=rate)
    ref, ref_lse = logspace_attention_reference(*expected, causal=True, rotary=rotary, offset=5, key_offset=1,
                                                return_log_normalizer=True, log_decay=rate)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-9)
    generator = torch.Generator().manual_seed(4)
    weights = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((out * weights).sum() + lse.sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weights).sum() + ref_lse.sum(), expected)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("rotary", [True, False])
def test_gradcheck(rotary, backend):
    generator = torch.Generator().manual_seed(5)
    inputs = [(torch.randn(1, 2, 7, 4, generator=generator, dtype=torch.float64) * s).requires_grad_()
              for s in (3, 3, 1)]
    attend = partial(functional.linear_attention, causal=True, rotary=rotary, chunk_size=3, offset=4, key_offset=1,
                     backend=backend, log_space=True, return_log_normalizer=True, log_decay=LOG_DECAY)
    assert torch.autograd.gradcheck(lambda b, a, v: attend(b, a, v), inputs)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("rotary", [True, False])
def test_decoding_continues_the_parallel_pass(rotary, backend):
    """A prefill with its state, then steps with the same decay: the parallel pass over the whole sequence."""
    (b, a, v), _ = leaves(6, n=N + 6, scale=3.0)
    whole = logspace_attention_reference(b, a, v, causal=True, rotary=rotary, offset=3, log_decay=LOG_DECAY)
    out, state = functional.linear_attention(b[:, :, :N], a[:, :, :N], v[:, :, :N], causal=True, rotary=rotary,
                                             offset=3, chunk_size=6, backend=backend, log_space=True,
                                             return_state=True, log_decay=LOG_DECAY)
    steps = [out]
    for n in range(N, N + 6):
        step, state = functional.linear_attention_step(b[:, :, n], a[:, :, n], v[:, :, n], state, rotary=rotary,
                                                       log_space=True, log_decay=LOG_DECAY)
        steps.append(step.unsqueeze(2))
    assert state.position == 3 + N + 6
    torch.testing.assert_close(torch.cat(steps, 2), whole, rtol=1e-10, atol=1e-12)


def folded(b, a, log_decay):
    """The decay folded into the log-features as before issue 45 item 4: b_j + j log gamma, a_n - n log gamma."""
    steps = torch.arange(b.shape[-2], dtype=b.dtype)[:, None] * log_decay.to(b.dtype)[:, None, None]
    return b + steps, a - steps


def far_errors(backend: str, far: int, tail: int = 48):
    """Relative errors (decay in the op, decay folded) of float32 outputs of the last `tail` queries of a call of
    far + tail tokens whose first `far` keys are exactly 0 (log -inf), against the float64 reference of the
    tail alone: the same weights, the distances being the same."""
    generator = torch.Generator().manual_seed(7)
    b, a = (torch.randn(1, 2, far + tail, 8, generator=generator) for _ in range(2))
    a[:, :, :far] = float("-inf")
    v = torch.randn(1, 2, far + tail, 4, generator=generator)
    log_decay = torch.log1p(-torch.tensor([2.0 ** -5, 2.0 ** -6]))    # retnet's first two heads
    tail_of = partial(torch.narrow, dim=2, start=far, length=tail)
    want = logspace_attention_reference(*(tail_of(t).double() for t in (b, a, v)), causal=True, rotary=False,
                                        log_decay=log_decay.double())
    attend = partial(functional.linear_attention, causal=True, rotary=False, chunk_size=64, backend=backend,
                     log_space=True)
    inside = tail_of(attend(b, a, v, log_decay=log_decay)).double()
    fold = tail_of(attend(*folded(b, a, log_decay), v)).double()
    scale = want.abs().max()
    return ((inside - want).abs().max() / scale).item(), ((fold - want).abs().max() / scale).item()


@pytest.mark.parametrize("backend", ["cpp", pytest.param("torch", marks=pytest.mark.slow)])
def test_the_decay_is_exact_far_into_a_sequence_where_folding_it_was_not(backend):
    """At token 1e5 in float32 the fold's error grows to ~1e-4 (its terms j log gamma are ~3e3, rounded to
    float32's 2.4e-4 there); the decay inside the chunks keeps float32's error of a short sequence."""
    near_inside, near_fold = far_errors(backend, 64)
    far_inside, far_fold = far_errors(backend, 100_000)
    assert near_inside < 2e-6 and near_fold < 2e-6
    assert far_inside < 2e-6
    assert far_fold > 2e-5


@pytest.fixture
def fla_route_on_cpu(monkeypatch):
    """The fla backend on CPU tensors, fla's kernel stood in by its exact recurrence (test_fla_kernels.py's
    `fake_fla`), so that the errors measured are the route's own."""
    from tests.linattn.ops.linear_attention.test_fla_kernels import fake_fla
    fake_fla(monkeypatch)
    monkeypatch.setattr(dispatch, "resolve", lambda backend, *args, **kwargs: backend)


@pytest.mark.slow
def test_the_fla_routes_decay_is_exact_far_into_a_sequence_where_folding_it_was_not(fla_route_on_cpu, monkeypatch):
    """The fla route on torch's glue (the fused kernels' reference; 1e5 tokens are beyond Triton's interpreter)
    at token 1e5 in float32: the decay in fla's gates keeps a short sequence's error (about 2e-7), where the fold
    it replaced erred by 5e-5."""
    monkeypatch.setattr(fla_kernels, "kernels_run_on", lambda x: x.is_cuda)
    near_inside, near_fold = far_errors("fla", 64)
    far_inside, far_fold = far_errors("fla", 100_000)
    assert near_inside < 1e-6 and near_fold < 1e-6
    assert far_inside < 1e-6
    assert far_fold > 2e-5


@pytest.mark.fused
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the kernels run on CUDA, or in Triton's interpreter on CPU")
@pytest.mark.parametrize("lead", [1_000_000])   # the fold erred by 9e-5 at 1e5 and 3e-4 at 1e6
def test_the_fla_kernels_weigh_queries_far_ahead_of_their_keys_exactly(fla_route_on_cpu, monkeypatch, lead):
    """Queries `lead` positions after their keys (offset - key_offset) on the fla route's own kernels (chunks of
    8 tokens), float32, against the float64 reference: the lead is a constant per head that only the
    log-normaliser sees.  The fold put lead log gamma (-3e3, -3e4) into every query's log-features, where
    float32 rounds by 2e-4 and 2e-3: its outputs erred by 9e-5 and 3e-4."""
    monkeypatch.setattr(pytest.importorskip("linattn.ops.linear_attention.factor_kernels"), "CHUNK", 8)
    generator = torch.Generator().manual_seed(8)
    b, a = (torch.randn(1, 2, 30, 8, generator=generator) for _ in range(2))
    v = torch.randn(1, 2, 30, 4, generator=generator)
    log_decay = torch.log1p(-torch.tensor([2.0 ** -5, 2.0 ** -6]))
    positions = dict(offset=lead + 5, key_offset=5)
    out, lse = functional.linear_attention(b, a, v, causal=True, rotary=False, backend="fla", log_space=True,
                                           return_log_normalizer=True, log_decay=log_decay, **positions)
    want, want_lse = logspace_attention_reference(b.double(), a.double(), v.double(), causal=True, rotary=False,
                                                  return_log_normalizer=True, log_decay=log_decay.double(),
                                                  **positions)
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 1e-6
    torch.testing.assert_close(lse.double(), want_lse, rtol=2e-7, atol=0.0)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_custom_op_registration_with_a_decay(backend):
    """torch.library.opcheck: the op's schema, fake and autograd with the decay."""
    q, k, v = (torch.randn(2, 1, 6, size).requires_grad_() for size in (4, 4, 3))
    arguments = (q, None, None, 0.0, 0.0, k, None, None, 0.0, 0.0, v, True, True, 5, 4, 10000.0, True, backend, True,
                 True, 1, True, torch.tensor([-0.3]))
    torch.library.opcheck(linear_attention_op, arguments)


@pytest.mark.parametrize("log_decay, options, word", [
    (torch.tensor([-0.1, -0.2, -0.3]), {}, "shape"), (torch.tensor([[-0.1, -0.2]]), {}, "shape"),
    (torch.tensor([0.1, -0.2]), {}, "<= 0"), (torch.tensor([math.nan, -0.2]), {}, "finite"),
    (torch.tensor([-math.inf, -0.2]), {}, "finite"), (torch.tensor([-1, 0]), {}, "floating"),
    ([-0.1, -0.2], {}, "tensor"), (torch.tensor([-0.1, -0.2]), {"causal": False}, "causal")])
def test_bad_decays_are_refused(log_decay, options, word):
    phi = torch.rand(1, 2, 4, 2)
    call = dict(causal=True, rotary=False, log_space=True) | options
    with pytest.raises(ValueError, match=word):
        functional.linear_attention(phi, phi, phi, log_decay=log_decay, **call)


def test_a_step_refuses_a_bad_decay():
    phi = torch.rand(1, 2, 2)
    with pytest.raises(ValueError, match="<= 0"):
        functional.linear_attention_step(phi, phi, phi, None, rotary=False, log_space=True,
                                         log_decay=torch.tensor([0.5, 0.0]))
    with pytest.raises(ValueError, match="log_space"):
        functional.linear_attention_step(phi, phi, phi, None, rotary=False, log_decay=torch.tensor([-0.5, 0.0]))


@pytest.mark.parametrize("log_space", [True, False])
def test_a_bad_decay_that_is_not_read_on_the_host_makes_its_head_nan(log_space):
    """Under torch.compile (as on a GPU outside debug mode) the values are not read: the head is NaN instead."""
    phi = torch.randn(1, 2, 5, 2) if log_space else torch.rand(1, 2, 5, 2)
    attend = torch.compile(partial(functional.linear_attention, causal=True, rotary=False, log_space=log_space),
                           fullgraph=True, backend="aot_eager")
    out = attend(phi, phi, phi, log_decay=torch.tensor([0.5, -0.1]))
    assert out[:, 0].isnan().all() and out[:, 1].isfinite().all()
