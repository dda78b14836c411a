"""Log-space linear attention (stable.py's numerics): exact Eq. 19 from log-features at any scale,
strictly causal, against an O(N^2) float64 reference that never exponentiates more than it must.
What the algorithm promises is checked on both CPU backends (`attend`): torch_logspace.py's torch ops and the
C++ kernel that runs their regular chunks (cpp_logspace.py); torch_logspace.py's internals on the torch backend."""
from functools import partial

import pytest
import torch

from benchmarks.timing import kept_for_backward
from linattn import LinearAttention, functional
from linattn.feature_maps import FavorFeatureMap
from linattn.functional import linear_attention_reference, linear_attention_step
from linattn.ops.linear_attention import torch_logspace
from linattn.ops.linear_attention.naive import logspace_attention_reference

linear_attention = partial(functional.linear_attention, backend="torch")   # torch_logspace.py's own ops


@pytest.fixture(params=["torch", "cpp"])
def attend(request):
    """linear_attention on one CPU backend."""
    return partial(functional.linear_attention, backend=request.param)


def log_features(*shape, scale, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=dtype) * scale


def query_log_features(*shape, scale, **kwargs):
    """Query log-features whose two coordinates of each pair differ by under 1% of `scale`: the
    rotated numerator of Eq. 19 is then within e^(1% of scale) of the denominator, below the cap."""
    b = log_features(*shape, scale=scale, **kwargs)
    return b.unflatten(-1, (-1, 2)).mean(-1, keepdim=True).expand(*b.shape[:-1], -1, 2).flatten(-2) + b * 0.005


@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_reference_agrees_with_plain_features_where_they_do_not_underflow(rotary, causal):
    b, a, v = log_features(2, 3, 9, 8, scale=1), log_features(2, 3, 9, 8, scale=1, seed=1), \
        log_features(2, 3, 9, 4, scale=1, seed=2)
    plain = linear_attention_reference(b.exp(), a.exp(), v, causal=causal, rotary=rotary, offset=5)
    torch.testing.assert_close(logspace_attention_reference(b, a, v, causal=causal, rotary=rotary, offset=5), plain)


@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [1, 30, 300])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 64])
def test_matches_the_reference_at_any_scale(rotary, causal, scale, chunk_size, attend):
    """scale 300: logits far beyond exp's range, with running maxima that jump inside chunks (far
    past JUMP_LIMIT).  The same-coordinate maxima keep Eq. 19's output within range here."""
    n = 23
    b, a = query_log_features(1, 2, n, 8, scale=scale), log_features(1, 2, n, 8, scale=scale, seed=1)
    v = log_features(1, 2, n, 3, scale=1, seed=2)
    expected = logspace_attention_reference(b, a, v, causal=causal, rotary=rotary, offset=3)
    out = attend(b, a, v, causal=causal, rotary=rotary, offset=3, chunk_size=chunk_size,
                           log_space=True)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)


def test_keys_whose_maximum_jumps_every_token_give_the_reference(attend):
    """Keys growing by 40 per token: every row's running max jumps past JUMP_LIMIT within its chunk
    (the C++ kernel hands such chunks to torch_logspace.py)."""
    n = 12
    a = torch.arange(n, dtype=torch.float64).mul(40).view(1, 1, n, 1).expand(1, 1, n, 4).contiguous()
    a = a + log_features(1, 1, n, 4, scale=1)
    b, v = log_features(1, 1, n, 4, scale=1, seed=1), log_features(1, 1, n, 2, scale=1, seed=2)
    expected = logspace_attention_reference(b, a, v, causal=True, rotary=True)
    for chunk_size in (4, 12):
        out = attend(b, a, v, causal=True, rotary=True, chunk_size=chunk_size, log_space=True)
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)


def test_gradients_where_maxima_jump_are_the_same_bits_every_time(attend):
    """Rows whose running max jumps share their chunk's keys, values and state.  Once gathered by
    advanced indexing, their gradients were summed by parallel atomic adds (CPU float32, 2 threads), in
    an order that varied from call to call, and so did training runs."""
    length, generator = 64, torch.Generator().manual_seed(0)
    b, a = (torch.randn(1, 1, 3 * length, 128, generator=generator) for _ in range(2))
    a[..., length + 1:2 * length, 0] += 60.0   # the rows of chunk 1 after its first token are exact,
    b[..., 0] -= 60.0                          # and its state still weighs in their outputs
    v, out_grad = (torch.randn(1, 1, 3 * length, 32, generator=generator) for _ in range(2))
    leaves = [t.requires_grad_() for t in (b, a, v)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results = set()
        for _ in range(6):
            out = attend(b, a, v, causal=True, rotary=True, log_space=True, chunk_size=length)
            results.add(b"".join(g.numpy().tobytes() for g in torch.autograd.grad(out, leaves, out_grad)))
    finally:
        torch.set_num_threads(threads)
    assert len(results) == 1, f"{len(results)} different gradients from 6 identical calls"

@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("scale", [3, 20])
def test_gradients_match_the_reference(rotary, scale, attend):
    """scale 3: a pair's key maxima stay within PAIR_SPREAD, so numerator factors are the
    denominator's times e^(P - F); scale 20: wide pairs, whose queries take their own exponential."""
    b, a = query_log_features(1, 2, 11, 6, scale=scale), log_features(1, 2, 11, 6, scale=scale, seed=1)
    v = log_features(1, 2, 11, 3, scale=1, seed=2)
    inputs = [t.clone().requires_grad_(True) for t in (b, a, v)]
    expected = [t.clone().requires_grad_(True) for t in (b, a, v)]
    out = attend(*inputs, causal=True, rotary=rotary, chunk_size=4, log_space=True)
    ref = logspace_attention_reference(*expected, causal=True, rotary=rotary)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weights).sum(), expected)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("rotary", [True, False])
def test_past_outputs_are_bitwise_unchanged_when_future_tokens_change(rotary, attend):
    b, a = log_features(1, 2, 40, 8, scale=50, dtype=torch.float32), \
        log_features(1, 2, 40, 8, scale=50, dtype=torch.float32, seed=1)
    v = log_features(1, 2, 40, 4, scale=1, dtype=torch.float32, seed=2)
    out = attend(b, a, v, causal=True, rotary=rotary, chunk_size=16, log_space=True)
    for t in (5, 17, 32):            # the first changed token: mid-chunk, after a chunk start
        b2, a2, v2 = b.clone(), a.clone(), v.clone()
        a2[:, :, t:] += 500.0        # a key maximum jumps inside the chunk
        b2[:, :, t:] *= -3
        v2[:, :, t:] = 7.0
        changed = attend(b2, a2, v2, causal=True, rotary=rotary, chunk_size=16, log_space=True)
        assert torch.equal(out[:, :, :t], changed[:, :, :t])


@pytest.mark.parametrize("rotary", [True, False])
def test_state_hand_off_and_steps_continue_the_parallel_pass(rotary, attend):
    b, a = query_log_features(2, 2, 30, 6, scale=40), log_features(2, 2, 30, 6, scale=40, seed=1)
    v = log_features(2, 2, 30, 3, scale=1, seed=2)
    full = attend(b, a, v, causal=True, rotary=rotary, offset=9, chunk_size=8, log_space=True)
    out, state = attend(b[:, :, :17], a[:, :, :17], v[:, :, :17], causal=True, rotary=rotary,
                                  offset=9, chunk_size=8, log_space=True, return_state=True)
    assert state.position == 26 and state.log_scale.shape == (2, 2, 6)
    steps = []
    for t in range(17, 30):
        y, state = linear_attention_step(b[:, :, t], a[:, :, t], v[:, :, t], state, rotary=rotary,
                                         log_space=True)
        steps.append(y)
    torch.testing.assert_close(torch.cat([out, torch.stack(steps, 2)], 2), full, rtol=1e-10, atol=1e-10)


def test_steps_from_scratch_match_the_parallel_pass(attend):
    b, a = query_log_features(1, 2, 10, 4, scale=60), log_features(1, 2, 10, 4, scale=60, seed=1)
    v = log_features(1, 2, 10, 3, scale=1, seed=2)
    state, steps = None, []
    for t in range(10):
        y, state = linear_attention_step(b[:, :, t], a[:, :, t], v[:, :, t], state, rotary=True, log_space=True)
        steps.append(y)
    full = attend(b, a, v, causal=True, rotary=True, log_space=True)
    torch.testing.assert_close(torch.stack(steps, 2), full, rtol=1e-10, atol=1e-10)


def test_a_plain_state_cannot_continue_with_log_features():
    b = torch.randn(1, 1, 4, 2)
    _, state = linear_attention(b.exp(), b.exp(), b, causal=True, rotary=False, return_state=True)
    with pytest.raises(ValueError, match="log_space"):
        linear_attention_step(b[:, :, 0], b[:, :, 0], b[:, :, 0], state, rotary=False, log_space=True)


def test_empty_sequence_gives_empty_output_and_an_empty_state(attend):
    b = torch.zeros(1, 2, 0, 4)
    out, state = attend(b, b, b, causal=True, rotary=True, offset=3, log_space=True,
                                  return_state=True)
    assert out.shape == (1, 2, 0, 4) and state.position == 3 and torch.isneginf(state.log_scale).all()


@pytest.mark.parametrize("shape", [(0, 2, 10, 3), (1, 0, 10, 3), (1, 2, 10, 0)])
def test_an_empty_batch_heads_or_values_give_empty_outputs_and_the_keys_state(shape, attend):
    b = log_features(*shape[:3], 4, scale=1, dtype=torch.float32).requires_grad_()
    v = torch.zeros(shape, requires_grad=True)
    out, state = attend(b, b, v, causal=True, rotary=True, log_space=True, chunk_size=4, return_state=True)
    out.sum().backward()
    assert out.shape == shape and state.position == 10 and state.kv.shape == (*shape[:2], 4, shape[3])
    _, with_values = attend(b, b, torch.zeros(*shape[:3], 1), causal=True, rotary=True, log_space=True,
                            chunk_size=4, return_state=True)
    torch.testing.assert_close(state.k_sum, with_values.k_sum)
    torch.testing.assert_close(state.log_scale, with_values.log_scale)


def test_capped_numerator_saturates_instead_of_overflowing(attend):
    """A query whose two coordinates of a pair differ by 200 in log space, against keys that favour
    the other coordinate: Eq. 19's exact output is about e^200 * |v|, beyond float32.  The capped
    numerator keeps it finite (and the gradients too) instead of returning inf or NaN."""
    b = torch.tensor([[[[0.0, -200.0]]]]).expand(1, 1, 3, 2).contiguous().requires_grad_(True)
    a = torch.tensor([[[[-200.0, 0.0]]]]).expand(1, 1, 3, 2).contiguous().requires_grad_(True)
    v = torch.ones(1, 1, 3, 1, requires_grad=True)
    out = attend(b, a, v, causal=True, rotary=True, log_space=True)
    out.sum().backward()
    assert torch.isfinite(out).all() and out.abs().max() > 1e10
    assert all(torch.isfinite(t.grad).all() for t in (b, a, v))


def test_rotated_block_is_exact_where_eq19_is_in_range_and_never_zero():
    """rope='post' at |x| = 30: the exact output (float64, same path) is reached in float32; no row
    is zero.  (Eq. 19's rotated numerator is not bounded by its unrotated denominator, so its exact
    output grows with the input scale: about 1e28 here.)"""
    torch.manual_seed(0)
    block = LinearAttention(64, 4, rope="post")
    x = torch.randn(2, 40, 64) * 30
    y = block(x)
    exact = block.double()(x.double())
    assert not (y == 0).all(-1).any()
    row_error = (y.double() - exact).abs().amax(-1)   # each row against its own scale (rows span 15 to 1e14)
    assert (row_error <= 1e-3 * exact.abs().amax(-1)).all(), row_error.max()


@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("n", [1, 13, 64, 70])
def test_float32_gradients_stay_finite_for_ragged_lengths_at_large_scale(rotary, n, attend):
    """Padding of a ragged last chunk must read and weigh nothing, even where e^(scale) is inf."""
    b = query_log_features(1, 2, n, 8, scale=200, dtype=torch.float32).requires_grad_(True)
    a = log_features(1, 2, n, 8, scale=200, dtype=torch.float32, seed=1).add(150).requires_grad_(True)
    v = log_features(1, 2, n, 3, scale=1, dtype=torch.float32, seed=2).requires_grad_(True)
    out = attend(b, a, v, causal=True, rotary=rotary, chunk_size=64, log_space=True)
    out.sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in (b, a, v))


def test_block_takes_log_features_on_both_backends_and_decodes_after_a_kernel_prefill():
    """FAVOR+ gives log-features to either backend (elu has none); the C++ kernel's prefill hands the
    step a state that carries F, and decoding continues the torch backend's sequence (the fla
    backend's hand-off: test_fla_kernels.py)."""
    from linattn.ops.linear_attention.cpp_logspace import unavailable
    if unavailable() is not None:
        pytest.skip(unavailable())
    assert not LinearAttention(16, 2, feature_map="elu").feature_map.log_space
    torch.manual_seed(0)
    block = LinearAttention(16, 2, backend="cpp", feature_map_options={"num_features": 16})
    x = torch.randn(1, 6, 16)
    _, state = block(x[:, :5], return_state=True)
    last, state = block.step(x[:, 5], state)
    assert state.log_scale is not None and state.position == 6
    block.backend = "torch"
    torch.testing.assert_close(last, block(x)[:, 5], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("state_group", [1, 2, 16])
@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("jumps", [False, True])
def test_backward_matches_the_reference_whatever_the_saved_state_spacing(state_group, rotary, jumps, monkeypatch):
    """Backward recomputes the states of a group of chunks from the one saved before it, then each run's
    forward for autograd; with `jumps`, keys grow by 40 every 5 tokens (maxima that jump inside chunks)."""
    monkeypatch.setattr(torch_logspace, "STATE_GROUP", state_group)
    b, a = query_log_features(1, 2, 23, 6, scale=3), log_features(1, 2, 23, 6, scale=3, seed=1)
    if jumps:
        a = a + torch.arange(2, 25, dtype=torch.float64).div(8).floor().mul(40).view(1, 1, 23, 1)
    v = log_features(1, 2, 23, 3, scale=1, seed=2)
    inputs = [t.clone().requires_grad_(True) for t in (b, a, v)]
    expected = [t.clone().requires_grad_(True) for t in (b, a, v)]
    out = linear_attention(*inputs, causal=True, rotary=rotary, chunk_size=4, offset=2, log_space=True)
    ref = logspace_attention_reference(*expected, causal=True, rotary=rotary, offset=2)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    weights = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad((out * weights).sum(), inputs),
                         torch.autograd.grad((ref * weights).sum(), expected)):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("rotary", [True, False])
def test_gradcheck_in_float64_with_ragged_chunks(rotary, attend):
    b, a = query_log_features(1, 2, 7, 4, scale=3), log_features(1, 2, 7, 4, scale=3, seed=1)
    v = log_features(1, 2, 7, 2, scale=1, seed=2)
    inputs = [t.clone().requires_grad_(True) for t in (b, a, v)]
    assert torch.autograd.gradcheck(
        lambda b, a, v: attend(b, a, v, causal=True, rotary=rotary, chunk_size=3, offset=4,
                                         log_space=True), inputs)


def chunk_calls(monkeypatch):
    """How many chunks each forward call of `torch_logspace._chunks` computed together, in order."""
    calls, original = [], torch_logspace._chunks
    monkeypatch.setattr(torch_logspace, "_chunks", lambda b, *args, **kwargs: calls.append(b.shape[2]) or
                        original(b, *args, **kwargs))
    return calls


@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("jumps", [False, True])
def test_runs_of_chunks_agree_with_one_chunk_at_a_time(rotary, jumps, monkeypatch):
    """Chunks are computed in batched runs; one chunk per run (RUN_ELEMENTS = 1) gives the same
    outputs, states and gradients (up to rounding: a batched product may round differently)."""
    b, a = log_features(2, 3, 150, 8, scale=3, seed=3), log_features(2, 3, 150, 8, scale=3, seed=4)
    if jumps:   # maxima that jump inside chunks (the first run) and wide pairs (the last)
        a = a + torch.arange(150, dtype=torch.float64).div(37).floor().mul(45).view(1, 1, 150, 1)
        a[:, :, 140:, 1::2] += 25
    v = log_features(2, 3, 150, 5, scale=1, seed=5)
    weights = log_features(2, 3, 150, 5, scale=1, seed=6)
    results = []
    for run_elements in (torch_logspace.RUN_ELEMENTS, 1):
        monkeypatch.setattr(torch_logspace, "RUN_ELEMENTS", run_elements)
        calls = chunk_calls(monkeypatch)
        inputs = [t.clone().requires_grad_() for t in (b, a, v)]
        out, state = linear_attention(*inputs, causal=True, rotary=rotary, chunk_size=8, offset=3,
                                      log_space=True, return_state=True)
        assert (max(calls) > 1) == (run_elements > 1)
        results.append((out, *state[:2], state.log_scale,
                        *torch.autograd.grad((out * weights).sum(), inputs)))
    for batched, one_by_one in zip(*results):
        torch.testing.assert_close(batched, one_by_one, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rotary,n,m,dv,length,t", [
    (True, 48, 2, 1, 3, 40), (False, 256, 8, 4, 64, 200), (False, 48, 16, 9, 3, 40)])
def test_a_jump_later_in_a_run_leaves_earlier_outputs_bitwise_unchanged(rotary, n, m, dv, length, t,
                                                                         monkeypatch):
    """A key that jumps in a later chunk of a run changes no op and no shape (the runs depend on N alone):
    every output before it keeps its bits (shapes where batched products and the complex rotation
    round differently per chunk than per run, found by review)."""
    b, a = log_features(1, 1, n, m, scale=3, dtype=torch.float32, seed=7), \
        log_features(1, 1, n, m, scale=3, dtype=torch.float32, seed=8)
    v = log_features(1, 1, n, dv, scale=1, dtype=torch.float32, seed=9)
    calls = chunk_calls(monkeypatch)
    out = linear_attention(b, a, v, causal=True, rotary=rotary, chunk_size=length, log_space=True)
    runs = list(calls)
    assert max(runs) > 1 and sum(runs) == -(-n // length)
    a[:, :, t:] += 100.0
    calls.clear()
    changed = linear_attention(b, a, v, causal=True, rotary=rotary, chunk_size=length, log_space=True)
    assert calls == runs
    assert torch.equal(out[:, :, :t], changed[:, :, :t])


def test_runs_cover_every_chunk_within_their_state_groups(monkeypatch):
    monkeypatch.setattr(torch_logspace, "STATE_GROUP", 4)
    monkeypatch.setattr(torch_logspace, "RUN_ELEMENTS", 3 * 2 * 8 * 5)   # three chunks of (B, H, L, Dv) = (1, 2, 8, 5)
    runs = torch_logspace._runs(torch.empty(1, 2, 85, 5), 3, 8)
    assert [(run.first, run.count) for run in runs] == [(0, 3), (3, 1), (4, 3), (7, 1), (8, 2), (10, 1)]
    assert [run.tokens for run in runs] == [slice(0, 24), slice(24, 32), slice(32, 56), slice(56, 64),
                                            slice(64, 80), slice(80, 85)]


def test_backward_saves_one_state_per_group_of_chunks_not_per_chunk():
    b = log_features(1, 2, 1000, 8, scale=1, dtype=torch.float32).requires_grad_(True)
    v = log_features(1, 2, 1000, 4, scale=1, dtype=torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        linear_attention(b, b, v, causal=True, rotary=True, chunk_size=10, log_space=True)
    states = [t for t in saved if t.shape == (1, 2, 8, 4)]
    assert len(states) == -(-100 // torch_logspace.STATE_GROUP)
    assert sum(t.numel() for t in saved) < 6 * b.numel()


def projection(n, *, jumps, seed=0, weight_grad=False, squared=False):
    """A LogProjection of (1, 2, n, 4) inputs onto 8 features; with `jumps`, shifts that grow by 40
    every 6 tokens (maxima that jump inside chunks); `squared`: a number shift and a squared-norm term
    instead of a shift tensor (FAVOR+'s form)."""
    inputs = log_features(1, 2, n, 4, scale=1, seed=seed)
    weight = log_features(8, 4, scale=1, seed=seed + 1)
    if squared:
        return functional.LogProjection(inputs.mul(1 + 10 * jumps).requires_grad_(), weight.requires_grad_(weight_grad),
                                    -1.5, -0.3)
    shift = log_features(1, 2, n, 1, scale=1, seed=seed + 2)
    if jumps:
        shift = shift + torch.arange(n, dtype=torch.float64).div(6).floor().mul(40).view(1, 1, n, 1)
    return functional.LogProjection(inputs.requires_grad_(), weight.requires_grad_(weight_grad),
                                shift.requires_grad_())


@pytest.mark.parametrize("squared", [False, True])
@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("jumps", [False, True])
@pytest.mark.parametrize("n", [5, 23])
def test_a_projection_gives_the_outputs_state_and_gradients_of_its_log_features(rotary, jumps, n, squared, attend):
    q_proj = projection(n, jumps=False, squared=squared)
    k_proj = projection(n, jumps=jumps, seed=3, weight_grad=True, squared=squared)
    v = log_features(1, 2, n, 3, scale=1, seed=9).requires_grad_()
    leaves = [t for t in (*q_proj, *k_proj, v) if isinstance(t, torch.Tensor)]
    kwargs = dict(causal=True, rotary=rotary, offset=4, chunk_size=4, log_space=True, return_state=True)
    out, state = attend(q_proj, k_proj, v, **kwargs)
    ref, ref_state = attend(q_proj.materialize(), k_proj.materialize(), v, **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(state, ref_state):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(out)
    used = [t for t in leaves if t.requires_grad]
    for got, want in zip(torch.autograd.grad((out * weights).sum(), used),
                         torch.autograd.grad((ref * weights).sum(), used)):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)


def test_non_causal_and_empty_projections_take_the_log_features(attend):
    q_proj, k_proj = projection(6, jumps=False), projection(6, jumps=False, seed=3)
    v = log_features(1, 2, 6, 3, scale=1, seed=9)
    torch.testing.assert_close(
        attend(q_proj, k_proj, v, causal=False, rotary=True, log_space=True),
        attend(q_proj.materialize(), k_proj.materialize(), v, causal=False, rotary=True,
                         log_space=True))
    empty = functional.LogProjection(torch.zeros(1, 2, 0, 4), torch.zeros(8, 4), torch.zeros(1, 2, 0, 1))
    assert attend(empty, empty, torch.zeros(1, 2, 0, 3), causal=True, rotary=True,
                            log_space=True).shape == (1, 2, 0, 3)


@pytest.mark.parametrize("bad, message", [
    (lambda p: p._replace(weight=torch.zeros(8, 5, dtype=torch.float64)), r"\(M, D\) weight"),
    (lambda p: p._replace(shift=torch.zeros(1, 2, 6, 2, dtype=torch.float64)), r"\(B, H, N, 1\) shift"),
    (lambda p: p._replace(inputs=torch.zeros(1, 2, 5, 4, dtype=torch.float64),
                          shift=torch.zeros(1, 2, 5, 1, dtype=torch.float64)), "disagree"),
    (lambda p: p._replace(weight=torch.zeros(6, 4, dtype=torch.float64)), "same feature map"),
    (lambda p: p.materialize()[..., :6], "same feature map"),
    (lambda p: p._replace(shift=torch.zeros(1, 2, 6, 1, dtype=torch.int64)),
     "LogProjection's shift must be a floating-point"),
    (lambda p: p._replace(shift=float("nan")), "shift must be .* finite number, got nan"),
    (lambda p: p._replace(shift=True), "shift must be .* finite number, got True"),
    (lambda p: p._replace(square_scale=float("inf")), "square_scale must be a finite number, got inf"),
    (lambda p: p._replace(square_scale=torch.tensor(1.0)),
     "square_scale must be a finite number"),
    (lambda p: p._replace(inputs=p.inputs.to(torch.int32)), "inputs must be a floating-point tensor"),
    (lambda p: p._replace(weight=p.weight.tolist()), "weight must be a floating-point tensor, got \\[\\["),
    (lambda p: p._replace(inputs=torch.zeros(1, 2, 6, 0), weight=torch.zeros(8, 0)), "D >= 1 inputs"),
    (lambda p: p.materialize()[..., :1], "same feature map"),
])
def test_bad_projections_are_refused_with_what_they_should_be(bad, message):
    q_proj, k_proj = projection(6, jumps=False), projection(6, jumps=False, seed=3)
    with pytest.raises(ValueError, match=message):
        linear_attention(q_proj, bad(k_proj), torch.zeros(1, 2, 6, 3, dtype=torch.float64), causal=True,
                         rotary=True, log_space=True)


def test_log_features_need_at_least_one_feature():
    empty = torch.zeros(1, 2, 6, 0)
    with pytest.raises(ValueError, match="at least one feature"):
        linear_attention(empty, empty, torch.zeros(1, 2, 6, 3), causal=True, rotary=False, log_space=True)


def test_a_projection_pairs_with_a_log_feature_tensor_and_needs_log_space(attend):
    q_proj, k_proj = projection(6, jumps=False), projection(6, jumps=False, seed=3)
    v = log_features(1, 2, 6, 3, scale=1, seed=9)
    torch.testing.assert_close(
        attend(q_proj, k_proj.materialize(), v, causal=True, rotary=True, log_space=True),
        attend(q_proj.materialize(), k_proj.materialize(), v, causal=True, rotary=True,
                         log_space=True))
    with pytest.raises(ValueError, match="log_space=True"):
        attend(q_proj, k_proj, v, causal=True, rotary=True)


def test_the_cap_acts_only_beyond_it_whatever_the_chunking(attend):
    """A wide pair (key scales 28 apart in one pair) with a query that leads by 20 within its pair:
    Eq. 19's output is 1.2e12, far below e^30, and every chunk size and the steps give it."""
    a = torch.tensor([[0.0, 40.0], [12.0, 40.0]], dtype=torch.float64).view(1, 1, 2, 2)
    b = torch.tensor([[0.0, 0.0], [20.0, -100.0]], dtype=torch.float64).view(1, 1, 2, 2)
    v = torch.tensor([[1.0], [2.0]], dtype=torch.float64).view(1, 1, 2, 1)
    expected = logspace_attention_reference(b, a, v, causal=True, rotary=True)
    for chunk_size in (1, 2):
        torch.testing.assert_close(attend(b, a, v, causal=True, rotary=True, log_space=True,
                                                    chunk_size=chunk_size), expected, rtol=1e-10, atol=0)
    state, steps = None, []
    for t in range(2):
        y, state = linear_attention_step(b[:, :, t], a[:, :, t], v[:, :, t], state, rotary=True, log_space=True)
        steps.append(y)
    torch.testing.assert_close(torch.stack(steps, 2), expected, rtol=1e-10, atol=0)


def test_favor_log_features_ignore_autocast():
    """Prefill projects in float32 inside the op; decoding's log_features must match it under autocast."""
    fm = FavorFeatureMap(16, seed=0)
    x = torch.randn(1, 2, 5, 16) * 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = fm.log_features(x, is_query=False)
    assert under.dtype == torch.float32
    torch.testing.assert_close(under, fm.log_features(x, is_query=False), rtol=0, atol=0)


def test_the_favor_block_saves_nothing_of_size_n_by_m_for_backward():
    """LinearAttention with FAVOR+ hands the causal op its projection: what autograd keeps is O(N D),
    not the (B, H, N, M) log-features."""
    torch.manual_seed(0)
    block = LinearAttention(64, 4, feature_map_options={"num_features": 128})   # D = 16, M = 128
    x = torch.randn(1, 512, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = block(x)
    assert max(t.numel() for t in saved) < 4 * 512 * 128 / 4
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_guard_keeps_a_mask_not_the_log_features_for_backward(attend):
    """Raising -inf log-features to their floor keeps which entries were -inf for backward, not a copy
    of the log-features: at most the op's own two (B, H, N, M) copies are kept."""
    b = query_log_features(1, 2, 40, 8, scale=1).requires_grad_(True)
    a = log_features(1, 2, 40, 8, scale=1, seed=1).requires_grad_(True)
    v = log_features(1, 2, 40, 3, scale=1, seed=2).requires_grad_(True)
    kept = kept_for_backward(lambda: attend(b, a, v, causal=True, rotary=True, log_space=True))
    assert len({t.untyped_storage().data_ptr() for t in kept if t.is_floating_point() and t.numel() == b.numel()}) <= 2
