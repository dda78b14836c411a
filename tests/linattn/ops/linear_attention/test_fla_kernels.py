"""The fla backend (fla_kernels.py): Eq. 19 mapped onto flash-linear-attention's chunk kernels.

Most tests call a stand-in `fla` package (`fake_fla`): fla 0.6.0's `chunk_gla` and
`chunk_linear_attn` with their signatures and (B, T, H, K) layout, computing the recurrence fla
documents (fla.ops.gla.naive.naive_recurrent_gla), optionally with the decays as fla's kernels see
them (a chunk-local float32 cumsum).  Tested in float64 against the torch backend: outputs, gradients
and states.  fla's own kernels run too: on CPU in Triton's interpreter (`fla_in_the_interpreter`, with
fla-core installed, as the dev extra does), and on a GPU (`gpu` marker), where the recurrence is
checked against them."""
import ast
import os
import sys
import types
from functools import partial

import pytest
import torch

from linattn import LinearAttention, resolve_backend
from linattn.functional import linear_attention, linear_attention_step
from linattn.ops.linear_attention import dispatch, fla_kernels, torch_logspace, torch_plain
from linattn.ops.linear_attention.common import (LogProjection, denominator_guard, guard_log_features,
                                                 query_key_phases)
from linattn.ops.linear_attention.naive import reference_attention
from linattn.ops.linear_attention.stable import NUMERATOR_CAP, pair_max
from linattn.ops.window_decay import window as window_decay

B, H = 2, 2
CUDA = torch.cuda.is_available()


def recurrent_gla(q, k, v, g, *, return_state, scale=1.0, chunk_cumsum=False):
    """S_n = diag(e^{g_n}) S_{n-1} + k_n v_n^T, o_n = scale q_n^T S_n, on (B, H, N, .) tensors.
    `chunk_cumsum`: the decays as fla's kernels see them, differences of a chunk-local (64 tokens)
    float32 cumsum of g, whose rounding absorbs small steps after a huge one."""
    if chunk_cumsum:
        sums = [c.float().cumsum(-2) for c in g.split(64, -2)]
        g = torch.cat([c.diff(dim=-2, prepend=torch.zeros_like(c[..., :1, :])) for c in sums], -2).to(g.dtype)
    state, outs = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1]), []
    for n in range(q.shape[-2]):
        state = state * g[..., n, :].exp().unsqueeze(-1) + k[..., n, :, None] * v[..., n, None, :]
        outs.append(scale * (q[..., n, :, None] * state).sum(-2))
    return torch.stack(outs, -2), (state if return_state else None)


# The route's own Triton kernels (factor_kernels.py) take 15-20 s a call in the interpreter.  They are held
# to torch's glue, their reference, by the tests that name them (`small_chunks`, the `fused` marker); the
# other tests of the route run it with that glue, as CPU tensors outside the interpreter do.
@pytest.fixture(autouse=True)
def route_on_torchs_glue(request, monkeypatch):
    uses_kernels = request.node.get_closest_marker("fused") or {"small_chunks", "fla_in_the_interpreter"} & set(
        request.fixturenames)
    if not uses_kernels and "triton" in sys.modules:
        monkeypatch.setattr(fla_kernels, "kernels_run_on", lambda x: x.is_cuda)


def fake_fla(monkeypatch, chunk_cumsum=False):
    """A stand-in `fla` package: chunk_gla and chunk_linear_attn as fla 0.6.0 declares them."""
    def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
                  cu_seqlens=None, cu_seqlens_cpu=None):
        assert initial_state is None and not state_v_first and cu_seqlens is None
        assert q.shape[-1] % 16 == 0 and v.shape[-1] % 16 == 0, "fla_kernels pads K and V to fla's tiles"
        heads_second = (t.transpose(1, 2) for t in (q, k, v, g))   # fla: [B, T, H, K]
        o, state = recurrent_gla(*heads_second, return_state=output_final_state,
                                 scale=q.shape[-1] ** -0.5 if scale is None else scale, chunk_cumsum=chunk_cumsum)
        return o.transpose(1, 2), state

    def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                          cu_seqlens=None):
        assert not normalize, "the stand-in covers normalize=False, the call fla_kernels makes"
        return chunk_gla(q, k, v, torch.zeros_like(q), scale, initial_state, output_final_state)

    def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                         state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        assert g is None and g_gamma is not None and g_gamma.dtype == torch.float32, "a constant decay per head"
        gates = g_gamma.to(q.dtype)[:, None].expand(q.shape[2:])   # (H, K): fla's g_gamma, for every step
        return chunk_gla(q, k, v, gates.expand_as(q), scale, initial_state, output_final_state)

    names = ("fla", "fla.ops", "fla.ops.gla", "fla.ops.linear_attn", "fla.ops.simple_gla")
    modules = {name: types.ModuleType(name) for name in names}
    modules["fla.ops.gla"].chunk_gla = chunk_gla
    modules["fla.ops.linear_attn"].chunk_linear_attn = chunk_linear_attn
    modules["fla.ops.simple_gla"].chunk_simple_gla = chunk_simple_gla
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture
def fla_reference(monkeypatch):
    """fla_kernels calling the stand-in fla package."""
    fake_fla(monkeypatch)


def features(n, m, dv, *, log_space, scale=1.0, seed=0, dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    b, a = (torch.randn(B, H, n, m, generator=gen, dtype=torch.float64) * scale for _ in range(2))
    v = torch.randn(B, H, n, dv, generator=gen, dtype=torch.float64)
    q, k = (b, a) if log_space else (b.exp(), a.exp())
    return [t.to(device, dtype).requires_grad_() for t in (q, k, v)]


def call(backend, log_space, tensors, **options):
    """One backend's entry ("fla" or "torch") for log-features or plain ones."""
    attend = {("fla", True): fla_kernels.logspace_attention, ("fla", False): fla_kernels.plain_attention,
              ("torch", True): torch_logspace.logspace_attention,
              ("torch", False): torch_plain.plain_attention}[backend, log_space]
    options = dict(causal=True, rotary=True, offset=0, rope_base=10000.0, chunk_size=8, return_state=False) | options
    return attend(*tensors, **options)


def outputs_and_grads(backend, log_space, tensors, weights, **options):
    out = call(backend, log_space, tensors, **options)
    return [out, *torch.autograd.grad((out * weights).sum(), tensors)]


@pytest.mark.parametrize("log_space", [True, False], ids=["log", "plain"])
@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
@pytest.mark.parametrize("n", [1, 9, 40])
@pytest.mark.parametrize("offset", [0, 7])
def test_mapping_matches_torch_backend(fla_reference, log_space, rotary, n, offset):
    tensors = features(n, 8, 4, log_space=log_space)
    weights = torch.randn(B, H, n, 4, dtype=torch.float64)
    got = outputs_and_grads("fla", log_space, tensors, weights, rotary=rotary, offset=offset)
    want = outputs_and_grads("torch", log_space, tensors, weights, rotary=rotary, offset=offset)
    for name, g, w in zip(("out", "d q", "d k", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("log_space,decay", [(True, False), (False, False), (False, True)],
                         ids=["log", "plain", "plain-decay"])
@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
@pytest.mark.parametrize("offset,key_offset", [(7, 2), (0, 5)])
def test_key_offset_and_log_normalizer_match_the_torch_backend(fla_reference, log_space, decay, rotary, offset,
                                                               key_offset):
    """The fla route's key offset, log-normaliser (and the plain pass's decay, fla's gates) and their
    gradients, as the torch backend's."""
    tensors = features(9, 8, 4, log_space=log_space, scale=3.0 if log_space else 1.0)
    gen = torch.Generator().manual_seed(5)
    weights, lse_weights = (torch.randn(B, H, 9, *size, generator=gen, dtype=torch.float64) for size in ((4,), ()))
    options = dict(log_decay=torch.tensor([-2.0 ** -1, -2.0 ** -4], dtype=torch.float64)) if decay else {}
    results = []
    for backend in ("fla", "torch"):
        out, state, lse = call(backend, log_space, tensors, rotary=rotary, offset=offset, key_offset=key_offset,
                               return_state=True, return_log_normalizer=True, **options)
        loss = (out * weights).sum() + (lse * lse_weights).sum()
        results.append([out, lse, state.kv, state.k_sum, *torch.autograd.grad(loss, tensors)])
        assert state.position == key_offset + 9
    for name, g, w in zip(("out", "log-normaliser", "kv", "k_sum", "d q", "d k", "dv"), *results):
        torch.testing.assert_close(g, w.to(g.dtype), rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("n,route,offset,key_offset", [(9, "glue", 7, 2), (9, "glue", 3, None), (40, "glue", 7, 2),
                                                      (40, "glue", 3, None),
                                                      pytest.param(40, "fused", 7, 2, marks=pytest.mark.fused)])
@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
@pytest.mark.parametrize("log_space", [True, False], ids=["log", "plain"])
def test_decay_matches_the_torch_backend(request, fla_reference, log_space, rotary, offset, key_offset, n, route):
    """The fla route's decay (in fla's gates and the denominator's sums) as the torch backend's (inside its
    chunks): outputs, log-normalisers, states (log-features: in the frame of the keys' next position; plain
    features: the decayed sums at the last key, as a block's step continues them) and gradients, on torch's
    glue (40 tokens: chunks of 16 carried) and on the fused kernels (chunks of 8)."""
    if route == "fused":
        request.getfixturevalue("small_chunks")
    tensors = features(n, 8, 4, log_space=log_space, scale=3.0 if log_space else 1.0)
    log_decay = torch.tensor([-0.125, -0.375], dtype=torch.float64)   # exact in fla's float32 g_gamma
    gen = torch.Generator().manual_seed(6)
    weights, lse_weights = (torch.randn(B, H, n, *size, generator=gen, dtype=torch.float64) for size in ((4,), ()))
    results = []
    for backend in ("fla", "torch"):
        out, state, lse = call(backend, log_space, tensors, rotary=rotary, offset=offset, key_offset=key_offset,
                               return_state=True, return_log_normalizer=True, log_decay=log_decay)
        loss = (out * weights).sum() + (lse * lse_weights).sum()
        parts = [state.kv, state.k_sum] + ([state.log_scale] if log_space else [])
        results.append([out, lse, *parts, *torch.autograd.grad(loss, tensors)])
    names = ("out", "log-normaliser", "kv", "k_sum", *(("log_scale",) if log_space else ()), "d q", "d k", "dv")
    for name, g, w in zip(names, *results, strict=True):
        torch.testing.assert_close(g, w.to(g.dtype), rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("log_space", [True, False], ids=["log", "plain"])
def test_state_equals_torch_backends_and_decoding_continues_from_it(fla_reference, log_space):
    tensors = [t.detach() for t in features(24, 8, 4, log_space=log_space)]
    prefix = [t[..., :20, :] for t in tensors]
    out, state = call("fla", log_space, prefix, offset=3, return_state=True)
    _, want = call("torch", log_space, prefix, offset=3, return_state=True)
    assert state.position == want.position == 23
    for name in ("kv", "k_sum", "log_scale"):
        got_part, want_part = getattr(state, name), getattr(want, name)
        assert (got_part is None) == (want_part is None), name
        if want_part is not None:
            torch.testing.assert_close(got_part, want_part, rtol=1e-10, atol=1e-12, msg=name)
    whole = call("torch", log_space, tensors, offset=3)
    for n in range(20, 24):
        step, state = linear_attention_step(*(t[..., n, :] for t in tensors), state, rotary=True, log_space=log_space)
        torch.testing.assert_close(step, whole[..., n, :], rtol=1e-10, atol=1e-12)


def test_a_decayed_plain_blocks_steps_continue_its_parallel_pass_on_fla(fla_reference, monkeypatch):
    """An elu block with RetNet's decays on the fla route (torch's glue, 40 tokens: its chunks of 16 carried):
    a forward pass over 36 tokens, then steps from its state, give the whole sequence's forward pass (to
    float32's rounding of gamma, which fla's gate takes and the steps do not)."""
    for module in (dispatch, window_decay):   # fla on CPU in float64: the stand-in
        monkeypatch.setattr(module, "resolve", lambda backend, *args, **kwargs: backend)
    block = LinearAttention(16, 2, feature_map="elu", rope="post", decay="retnet", backend="fla").double()
    x = torch.randn(B, 40, 16, dtype=torch.float64)
    whole = block(x)
    out, state = block(x[:, :36], return_state=True)
    torch.testing.assert_close(out, whole[:, :36], rtol=1e-10, atol=1e-12)
    for t in range(36, 40):
        step, state = block.step(x[:, t], state)
        torch.testing.assert_close(step, whole[:, t], rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("log_space", [True, False], ids=["log", "plain"])
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
def test_window_and_decay_run_their_linear_part_on_flas_kernels(fla_reference, monkeypatch, log_space, window, rotary):
    """The window's band stays in torch; its linear part (and a decay alone) takes fla's kernels: the same
    outputs, gradients and state as the torch backend, and no loop over chunks."""
    for module in (dispatch, window_decay):   # fla on CPU in float64: the stand-in
        monkeypatch.setattr(module, "resolve", lambda backend, *args, **kwargs: backend)
    n, d = 21, 8
    phi_q, phi_k, v = features(n, d, 4, log_space=log_space)
    gen = torch.Generator().manual_seed(3)
    q_hat, k_hat = (torch.randn(B, H, n, d, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    log_decay = torch.tensor([-2.0 ** -5, -2.0 ** -6], dtype=torch.float64)   # exact in fla's float32 g_gamma
    options = dict(window=window, log_decay=log_decay,
                   log_gain=torch.tensor([0.3, -0.2], dtype=torch.float64) if window else None, rotary=rotary,
                   log_space=log_space, offset=2, rope_base=10000.0, chunk_size=4, return_state=True)
    inputs, weights = (q_hat, k_hat, phi_q, phi_k, v), torch.randn(B, H, n, 4, dtype=torch.float64)
    runs = {}
    for backend in ("torch", "fla"):
        if backend == "fla":   # the torch loop over chunks must not run on the fla route
            monkeypatch.setattr(torch_plain, "causal_attention", None)
        out, state = window_decay.window_decay_attention(*inputs, backend=backend, **options)
        runs[backend] = [out, *torch.autograd.grad((out * weights).sum(), inputs, materialize_grads=True), state.linear.kv,
                         state.linear.k_sum]
    for name, got, want in zip(("out", "d q_hat", "d k_hat", "d phi_q", "d phi_k", "dv", "kv", "k_sum"),
                               runs["fla"], runs["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=name)



@pytest.mark.parametrize("log_space", [True, False], ids=["log", "plain"])
def test_second_derivatives_through_flas_kernels_are_refused(fla_reference, log_space):
    """fla's backward is kernels, with no graph of its gradients: a backward that builds one stops
    (the stand-in is torch ops, so this tests the glue's refusal, on every call of fla)."""
    tensors = features(9, 8, 4, log_space=log_space)
    with pytest.raises(RuntimeError, match="first derivatives"):
        torch.autograd.grad(call("fla", log_space, tensors).square().sum(), tensors, create_graph=True)
    assert all(g.isfinite().all() for g in torch.autograd.grad(call("fla", log_space, tensors).sum(), tensors))


def favor_like(n, m, scale, seed=0):
    """FAVOR+'s log-features w.x - |x|^2/2 of inputs x with |x| about `scale`."""
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(2, B, H, n, 16, generator=gen, dtype=torch.float64), torch.randn(m, 16, generator=gen)
    x = x * scale / x.norm(dim=-1, keepdim=True)
    b, a = (x @ w.double().T - x.square().sum(-1, keepdim=True) / 2)
    return b, a


@pytest.mark.parametrize("scale", [1.0, 30.0, 100.0])
def test_inputs_up_to_norm_100_give_finite_outputs_and_gradients_and_no_zero_row(fla_reference, scale):
    b, a = (t.float().requires_grad_() for t in favor_like(40, 16, scale))
    v = torch.randn(B, H, 40, 4, requires_grad=True)
    out = call("fla", True, [b, a, v])
    assert torch.isfinite(out).all() and (out.abs().amax(-1) > 0).all()
    grads = torch.autograd.grad(out.sum(), (b, a, v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_outputs_below_the_numerator_cap_are_exact_at_norm_100(fla_reference):
    """Rows whose query factors e^(b + P - Q) stay below e^NUMERATOR_CAP are exact (in float64, as the
    torch backend's); beyond the cap both saturate (finite), each its own way."""
    b, a = favor_like(40, 16, 100.0)
    v = torch.randn(B, H, 40, 4, dtype=torch.float64)
    got, want = (call(module, True, [b, a, v]) for module in ("fla", "torch"))
    feature_scale = a.cummax(-2).values
    row_scale = (b + feature_scale).amax(-1, keepdim=True)
    exact = (b + pair_max(feature_scale) - row_scale).amax(-1) <= NUMERATOR_CAP
    assert exact.sum() > 10
    torch.testing.assert_close(got[exact], want[exact], rtol=1e-5, atol=1e-8)


@pytest.mark.fused
def test_keys_of_exactly_zero_before_a_features_first_real_key_leave_the_decays_usable(monkeypatch):
    """Left padding: the first keys' features are exactly 0 (log -inf), so the first real key's
    running-max step is about -8.5e37 unless floored; fla's float32 chunk-local cumsum would then
    absorb every later step of the chunk (the stand-in does what its kernels do here).  Rows before
    the first real key are 0/0 in exact terms; each backend gives its own finite value there."""
    fake_fla(monkeypatch, chunk_cumsum=True)
    b, a, v = (t.detach() for t in features(70, 8, 4, log_space=True))   # a chunk of fla's 64 and a ragged one
    a[..., :3, :] = float("-inf")
    got = call("fla", True, [b, guard_log_features(a, a.dtype), v])   # the floor the public entry gives -inf
    want = linear_attention(b, a, v, causal=True, rotary=True, backend="torch", log_space=True, chunk_size=8)
    assert torch.isfinite(got[..., :3, :]).all()   # rows with no real key yet: 0/0 in exact terms
    torch.testing.assert_close(got[..., 3:, :], want[..., 3:, :], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("log_space", [True, False], ids=["log", "plain"])
def test_past_outputs_are_bitwise_unchanged_when_future_tokens_change(fla_reference, log_space):
    tensors = [t.detach() for t in features(30, 8, 4, log_space=log_space, scale=3.0)]
    changed = [t.clone() for t in tensors]
    for t in changed:
        t[..., 20:, :] = t[..., 20:, :] * 50 + 7
    before, after = (call("fla", log_space, ts) for ts in (tensors, changed))
    assert torch.equal(before[..., :20, :], after[..., :20, :])


class KeepsItsInputs(torch.autograd.Function):
    """A stand-in for fla's kernels that keeps what they keep for backward: their inputs."""
    @staticmethod
    def forward(ctx, *inputs):
        ctx.save_for_backward(*inputs)
        return inputs[2].clone()

    @staticmethod
    def backward(ctx, grad):   # some gradient for every input, so that it reaches the layer's inputs
        return tuple(grad if i == 2 else grad.sum().to(t.dtype).expand_as(t) for i, t in enumerate(ctx.saved_tensors))


@pytest.mark.fused
@pytest.mark.parametrize("inputs,most", [("log", 6.8), ("plain", 2.8), ("plain-decay", 2.8), ("projection", 8.9)])
def test_a_layer_keeps_its_inputs_and_flas_and_the_factors_scales_for_backward(monkeypatch, inputs, most):
    """In units of one (B, H, N, M) float32 tensor, at M = Dv, rotated: what fla keeps of its calls
    (log-features: the numerator's q, k, v in bf16 and float32 decays, the half numerator for the division;
    plain features: q, k, v in bf16), the phases, and for backward of factor_kernels.py the log-features
    b, a (2.0), L (1.0), P (0.5, per pair) and Q; or the plain bf16 features (1.0), the denominator and
    the keys' chunk sums (plain_factors: 2.8, with a decay too; two calls of fla, numerator and denominator,
    kept 3.6).
    FAVOR+'s block hands over a `LogProjection` (M = 4D here, as in the benchmark's block): its logits
    are kept too (8.9).  Before the fused kernels, the factors were recomputed in backward: 7.6, 3.6 and
    5.6 (the projection's logits recomputed from its (B, H, N, D) inputs); before issue 34, 5.0, 3.0, 3.0."""
    monkeypatch.setattr(fla_kernels, "gated_linear_attention",
                        lambda q, k, v, g, *, return_state: (KeepsItsInputs.apply(q, k, v, g), None))
    monkeypatch.setattr(fla_kernels, "plain_linear_attention",
                        lambda q, k, v, *, return_state: (KeepsItsInputs.apply(q, k, v), None))
    monkeypatch.setattr(fla_kernels, "decayed_linear_attention",
                        lambda q, k, v, gate, *, return_state: (KeepsItsInputs.apply(q, k, v), None))
    plain = inputs.startswith("plain")
    n, m = 64, 64   # one chunk: the units are ratios to (B, H, N, M)
    q, k, v = features(n, m, m, log_space=not plain, dtype=torch.float32)
    if plain:
        q, k = (t.detach().bfloat16().requires_grad_() for t in (q, k))
    if inputs == "projection":
        weight = torch.randn(m, m // 4, dtype=torch.float32)
        q, k = (LogProjection(t.detach()[..., :m // 4].requires_grad_(), weight, -2.0, -0.0625) for t in (q, k))
    v = v.detach().bfloat16().requires_grad_()
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        decay = dict(log_decay=torch.tensor([-0.1, -0.2])) if inputs == "plain-decay" else {}
        out = call("fla", not plain, [q, k, v], **decay)
    units = sum(kept.values()) / (B * H * n * m * 4)
    assert units <= most, units
    if inputs == "projection":   # and the gradient still reaches the projection's inputs
        assert torch.autograd.grad(out.float().sum(), q.inputs)[0].abs().sum() > 0


@pytest.mark.parametrize("log_space,values,dots", [
    (True, torch.bfloat16, torch.bfloat16), (True, torch.float16, torch.float32),   # e^30 > fp16's range
    (True, torch.float32, torch.float32), (False, torch.float16, torch.float32),   # sums beyond 65504
    (False, torch.bfloat16, torch.bfloat16)])
def test_fla_multiplies_bf16_values_in_bf16(monkeypatch, log_space, values, dots):
    seen = record_kernel_dtypes(monkeypatch)
    q, k, v = (t.detach() for t in features(8, 8, 4, log_space=log_space, dtype=torch.float32))
    if not log_space:
        q, k = q.to(values), k.to(values)
    out = call("fla", log_space, [q, k, v.to(values)])
    assert seen == [(dots, dots, dots)] and out.dtype == values   # one call: the denominator takes none


@pytest.mark.parametrize("log_space", [True, False], ids=["log", "plain"])
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("values,dots", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                         (torch.float32, torch.float32)])
def test_the_window_and_decays_linear_part_multiplies_bf16_values_in_bf16(monkeypatch, log_space, window, values,
                                                                          dots):
    """Float32 features and scores beside the block's values, as under autocast: the linear part's
    kernels get bf16 values as they are, the band and the result stay float32."""
    seen = record_kernel_dtypes(monkeypatch)
    for module in (dispatch, window_decay):   # the fla route on CPU
        monkeypatch.setattr(module, "resolve", lambda backend, *args, **kwargs: backend)
    phi_q, phi_k, v = (t.detach() for t in features(12, 8, 4, log_space=log_space, dtype=torch.float32))
    q_hat, k_hat = torch.randn(2, B, H, 12, 8).unbind()
    out = window_decay.window_decay_attention(
        q_hat, k_hat, phi_q, phi_k, v.to(values), window=window, log_decay=torch.tensor([-0.1, -0.2]),
        log_gain=torch.zeros(H) if window else None, rotary=True, log_space=log_space, offset=0, rope_base=10000.0,
        chunk_size=4, backend="fla", return_state=False)
    assert seen == [(dots, dots, dots)] and out.dtype == torch.float32   # one call: the denominator takes none


def record_kernel_dtypes(monkeypatch) -> list:
    """fla_kernels' calls of fla recorded as (q, k, v) dtypes, each answering with its values."""
    seen = []

    def kernel(q, k, v, *gates, return_state):
        seen.append((q.dtype, k.dtype, v.dtype))
        return v, None
    for name in ("gated_linear_attention", "plain_linear_attention", "decayed_linear_attention"):
        monkeypatch.setattr(fla_kernels, name, kernel)
    return seen


def test_non_causal_calls_take_the_torch_entry():
    for log_space in (True, False):
        assert (dispatch.implementation(log_space, "fla", False, 5)
                is dispatch.implementation(log_space, "torch", False, 5))
        assert dispatch.has_own_kernel(log_space, "fla", True)


FACTORS = ("q", "k", "decays", "denominator", "Q", "last F", "last L")   # log_factors' results
INTERPRETED_OR_CUDA = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not CUDA,
                                         reason="the kernels run on CUDA, or in Triton's interpreter on CPU")
KERNEL_DEVICE = "cuda" if CUDA else "cpu"


def factor_inputs(n, m, *, inputs, dtype=torch.float64, batch=2, heads=3, seed=0):
    """Log-features (B, H, N, M) for factor_kernels: sliced tensors (strides and an offset to honour), or
    `LogProjection`s with a tensor row shift (b) and a constant one (a), as FAVOR+'s are."""
    gen = torch.Generator().manual_seed(seed)
    if inputs == "tensor":
        return [(torch.randn(batch + 1, heads, n, m, generator=gen, dtype=torch.float64) * 3)[1:].to(
            KERNEL_DEVICE, dtype).requires_grad_() for _ in range(2)]
    weight = torch.randn(m, 8, generator=gen, dtype=torch.float64).to(KERNEL_DEVICE, dtype)
    x_b, x_a, shift = (torch.randn(batch, heads, n, d, generator=gen, dtype=torch.float64).to(KERNEL_DEVICE, dtype)
                       .requires_grad_() for d in (8, 8, 1))
    return [LogProjection(x_b, weight, shift, -0.1), LogProjection(x_a, weight, -1.5, -0.2)]


def leaves(features) -> list[torch.Tensor]:
    return [t for x in features for t in (x if isinstance(x, LogProjection) else (x,))
            if isinstance(t, torch.Tensor) and t.requires_grad]


def factors_and_grads(log_factors, features, *, rotary, key_offset=3, work=torch.float64, weights=None):
    """log_factors' seven results (fla_kernels.log_factors' call shape), queries rotated at 3.. and keys
    at key_offset.., and the gradients of a weighted sum of q, k and the denominator with respect to
    the inputs."""
    n, m = features[0].shape[-2:]
    phases = phases_at(n, m, 3, key_offset, work) if rotary else None
    out = log_factors(*features, phases, work=work, dot=work)
    weights = weights or [torch.randn_like(out[i]) for i in (0, 1, 3)]
    grads = torch.autograd.grad(sum((out[i] * w).sum() for i, w in zip((0, 1, 3), weights)), leaves(features))
    return out, grads, weights


def phases_at(n, m, offset, key_offset, dtype=torch.float64):
    """The queries' and keys' rotations as the op makes them, (2, N, M/2)."""
    return query_key_phases(n, m, offset=offset, key_offset=key_offset, base=10000.0, device=KERNEL_DEVICE,
                            dtype=dtype)


@pytest.fixture
def small_chunks(monkeypatch):
    """factor_kernels with chunks of 8 tokens: several chunks, carried both ways, at lengths the
    interpreter runs in seconds (a program walks its chunk token by token)."""
    factor_kernels = pytest.importorskip("linattn.ops.linear_attention.factor_kernels")   # triton's
    monkeypatch.setattr(factor_kernels, "CHUNK", 8)


def factor_kernel_cases():
    """Every inputs x placement pair at one and at eight tokens; at three chunks with a key offset (the
    interpreter's slowest), each inputs and each placement once with the decay and once without."""
    short = [(i, r, length, offset, False) for i in ("tensor", "projection") for r in ("post", "unrotated")
             for length, offset in ((1, 3), (8, 0))]
    long = [("tensor", "post", False), ("projection", "unrotated", False), ("projection", "post", True),
            ("tensor", "unrotated", True)]
    return [pytest.param(i, r == "post", 14 if r == "post" else 7, length, offset, decay,
                         id=f"{length}-{offset}-{decay}-{r}-{i}")
            for i, r, length, offset, decay in short + [(i, r, 21, 11, d) for i, r, d in long]]


@INTERPRETED_OR_CUDA
@pytest.mark.parametrize("inputs,rotary,m,length,key_offset,decay", factor_kernel_cases())
def test_the_factor_kernels_give_torchs_glue_and_its_gradients(small_chunks, inputs, rotary, m, length, key_offset,
                                                               decay):
    """factor_kernels.py against fla_kernels.log_factors (torch ops) in float64: fla's q, k and decays,
    the denominator, Q, F and L at the last token, and the gradients; ragged and several chunks, a row of
    M features that is no power of 2 (odd when unrotated), strided inputs, projections' row shifts, keys
    rotated at the queries' positions or at a key offset of their own, a decay per head (one of e^-2 a
    token, which moves F within and across chunks)."""
    features = factor_inputs(length, m, inputs=inputs)
    rate = torch.tensor([-0.3, -0.05, -2.0], dtype=torch.float64, device=KERNEL_DEVICE)
    rates = dict(log_decay=rate) if decay else {}
    got, got_grads, weights = factors_and_grads(partial(fla_kernels.fused_log_factors, **rates), features,
                                                rotary=rotary, key_offset=key_offset)
    want, want_grads, _ = factors_and_grads(partial(fla_kernels.log_factors, **rates), features, rotary=rotary,
                                            key_offset=key_offset, weights=weights)
    names = (*FACTORS, *(f"grad {i}" for i in range(len(want_grads))))
    for name, g, w in zip(names, (*got, *got_grads), (*want, *want_grads)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


PLAIN_FACTORS = ("q", "k", "denominator", "last sums", "d phi_q", "d phi_k")   # plain_factors' and the gradients
PLAIN_DECAY = torch.tensor([-0.3, -2.0], dtype=torch.float64)   # per head: mild, and e^-16 a chunk of 8


@INTERPRETED_OR_CUDA
@pytest.mark.parametrize("rotary,m,length,key_offset,decay", [
    (True, 14, 21, 11, False), (True, 8, 8, 3, False), (False, 7, 9, 3, False), (True, 14, 21, 11, True),
    (False, 7, 30, 3, True)], ids=["post-offset", "post", "unrotated", "post-offset-decay", "unrotated-decay"])
def test_the_plain_factor_kernels_give_torchs_glue_and_its_gradients(small_chunks, rotary, m, length, key_offset,
                                                                     decay):
    """factor_kernels.plain_factors against fla_kernels.plain_factors (torch ops) in float64: fla's q (divided
    by the denominator), k, the denominator, the keys' last sums, and the gradients of a weighted sum of
    q, k and the denominator; strided inputs in fla's layout, several chunks and a ragged one, a row of M
    features that is no power of 2, a zero denominator (the guard's), keys rotated at their own offset,
    the sums decayed per head (carried across chunks, and in the glue across its chunks of 16)."""
    gen = torch.Generator().manual_seed(4)
    phi_q, phi_k = ((torch.rand(3, 2, length, m, generator=gen, dtype=torch.float64))[1:].to(KERNEL_DEVICE)
                    .requires_grad_() for _ in range(2))
    with torch.no_grad():
        phi_q[0, 1, :2] = 0   # rows whose denominator is 0
    phases = phases_at(length, m, 3, key_offset) if rotary else None
    inputs = [fla_kernels.fla_layout(t) for t in (phi_q, phi_k)]
    rate = PLAIN_DECAY.to(KERNEL_DEVICE) if decay else None
    got = factor_kernels_module().plain_factors(*inputs, phases, dot=torch.float64,
                                                guard=denominator_guard(torch.float64), log_decay=rate)
    want = fla_kernels.plain_factors(*inputs, phases, work=torch.float64, dot=torch.float64, log_decay=rate)
    weights = [torch.randn_like(want[i]) for i in range(3)]
    runs = [[*out, *torch.autograd.grad(sum((out[i] * w).sum() for i, w in enumerate(weights)), (phi_q, phi_k))]
            for out in (got, want)]
    assert (want[2] == 0).any()
    for name, g, w in zip(PLAIN_FACTORS, *runs, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)
    if decay:   # and the glue's denominator as its definition has it: sum_n gamma^(t - n) phi_q_t . phi_k_n
        lags = torch.arange(length, dtype=torch.float64, device=KERNEL_DEVICE)
        lags = (lags[:, None] - lags).clamp_min(0)
        weights = torch.exp(lags * rate[:, None, None]).tril()   # (H, t, n)
        torch.testing.assert_close(want[2], torch.einsum("bhtm,bhnm,htn->bth", phi_q, phi_k, weights), rtol=1e-12,
                                   atol=1e-13)


@pytest.mark.fused
@INTERPRETED_OR_CUDA
def test_the_plain_decay_on_the_factor_kernels_is_exact_far_along(fla_reference, small_chunks, monkeypatch):
    """Plain features with a decay on the route's own kernels (chunks of 8, float32) at positions past 1e5,
    against the float64 reference: outputs, log-normalisers (with the queries' lead over their keys) and
    the state (the decayed sums at the last key).  One head's gamma^N (e^-240) is far below float32's
    range, so a decay folded into the features would lose it; carried between chunks it stays exact."""
    monkeypatch.setattr(dispatch, "resolve", lambda backend, *args, **kwargs: backend)
    gen = torch.Generator().manual_seed(9)
    n = 120
    phi_q, phi_k = (torch.rand(1, 2, n, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, n, 4, generator=gen, dtype=torch.float64)
    log_decay = torch.tensor([-2.0, -2.0 ** -5], dtype=torch.float64)
    options = dict(causal=True, rotary=True, offset=10 ** 5 + 7, key_offset=10 ** 5, return_log_normalizer=True)
    out, state, lse = linear_attention(*(t.float() for t in (phi_q, phi_k, v)), log_decay=log_decay.float(),
                                       backend="fla", return_state=True, **options)
    want, want_lse = reference_attention(phi_q, phi_k, v, log_decay=log_decay, **options)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)
    weights = torch.exp(torch.arange(n - 1, -1, -1, dtype=torch.float64) * log_decay[:, None])   # (H, N)
    torch.testing.assert_close(state.k_sum.double(), (weights[:, :, None] * phi_k).sum(-2), rtol=1e-5, atol=1e-6)


def factor_kernels_module():
    return pytest.importorskip("linattn.ops.linear_attention.factor_kernels")   # triton's


@INTERPRETED_OR_CUDA
def test_the_factor_kernels_guard_tensors_as_common_does(small_chunks):
    """guard=True: -inf (keys of exactly 0) raised to the floor in the kernels, as
    common.guard_log_features does before torch's glue (outputs and gradients), and a row beyond the
    limit made NaN (outputs: a gradient through a NaN row is no contract)."""
    def guarded_glue(b, a, *args, **options):
        return fla_kernels.log_factors(guard_log_features(b, torch.float64), guard_log_features(a, torch.float64),
                                       *args, **options)
    b, a = factor_inputs(17, 8, inputs="tensor", heads=2)   # three chunks, the last of one token
    with torch.no_grad():
        a[0, 1, :11, 2] = float("-inf")
    got, got_grads, weights = factors_and_grads(partial(fla_kernels.fused_log_factors, guard=True), [b, a],
                                                rotary=True)
    want, want_grads, _ = factors_and_grads(guarded_glue, [b, a], rotary=True, weights=weights)
    for g, w in zip((*got, *got_grads), (*want, *want_grads)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        b[1, 0, 15, 5] = 1e17   # beyond 2^52
        phases = phases_at(17, 8, 3, 3)
        got = fla_kernels.fused_log_factors(b, a, phases, work=torch.float64, dot=torch.float64, guard=True)
        want = guarded_glue(b, a, phases, work=torch.float64, dot=torch.float64)
    assert got[3][1, 15, 0].isnan() and got[3].isfinite().sum() == got[3].numel() - 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, equal_nan=True)


@INTERPRETED_OR_CUDA
def test_the_factor_kernels_keep_nan(small_chunks):
    """A NaN key feature is NaN in F and L from its token on, as torch's scans have it: the interpreter
    keeps NaN whatever the propagation flag; on a GPU this checks PropagateNan.ALL (the default drops it)."""
    b, a = factor_inputs(30, 8, inputs="tensor", dtype=torch.float32)
    with torch.no_grad():
        a[0, 1, 14, 3] = float("nan")
    got = fla_kernels.fused_log_factors(b, a, None, work=torch.float32, dot=torch.float32)
    want = fla_kernels.log_factors(b, a, None, work=torch.float32, dot=torch.float32)
    assert got[3][0, 14:, 1].isnan().all() and got[5][0, 1, 3].isnan()
    for name, g, w in zip(FACTORS, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, equal_nan=True, msg=name)


@pytest.mark.gpu
def test_gpu_the_factor_kernels_offset_past_two_to_the_31():
    """B N H M = 2^31 + 2^24 elements: int32 offsets would wrap (the interpreter's, in numpy, do not;
    and 2^31 floats do not fit this CPU's tests).  The last batch against the same kernels on it alone,
    where every offset is small: each (chunk, head) program does the same arithmetic, so the two agree
    to rounding, and a wrapped offset would read another batch's rows.  (Against torch's glue a GPU's
    fast exp and division would differ by ulps, which bf16's rounding turns into whole bf16 steps.)"""
    b, a = (torch.randn(17, 8, 65536, 256, device="cuda") for _ in range(2))
    phases = query_key_phases(65536, 256, offset=0, key_offset=0, base=10000.0, device="cuda", dtype=torch.float32)
    got = fla_kernels.fused_log_factors(b, a, phases, work=torch.float32, dot=torch.bfloat16)
    want = fla_kernels.fused_log_factors(b[-1:].clone(), a[-1:].clone(), phases, work=torch.float32,
                                         dot=torch.bfloat16)
    for g, w in zip(got, want):
        exact = torch.finfo(w.dtype).eps if w.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(g[-1:], w, rtol=exact, atol=1e-6)


@pytest.mark.gpu
def test_gpu_the_plain_factor_kernels_give_torchs_glue_at_length():
    """plain_factors on CUDA, bf16 features in the (B, H, N, M) layout as the elu block hands them, N = 8192
    (128 chunks), against torch's glue on them in float32: fla's q, k (bf16), the denominator and the
    gradients."""
    phi_q, phi_k = ((torch.randn(2, 4, 8192, 64, device="cuda") * 0.5).exp().bfloat16().requires_grad_()
                    for _ in range(2))
    phases = phases_at(8192, 64, 0, 0, torch.float32)
    inputs = [fla_kernels.fla_layout(t) for t in (phi_q, phi_k)]
    got = factor_kernels_module().plain_factors(*inputs, phases, dot=torch.bfloat16,
                                                guard=denominator_guard(torch.float32))
    want = fla_kernels.plain_factors(*inputs, phases, work=torch.float32, dot=torch.bfloat16)
    weights = [torch.randn_like(want[i].float()) for i in range(3)]
    runs = [[*out, *torch.autograd.grad(sum((out[i].float() * w).sum() for i, w in enumerate(weights)),
                                        (phi_q, phi_k))] for out in (got, want)]
    for name, g, w in zip(PLAIN_FACTORS, *runs, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2 * w.float().abs().max().item(),
                                   msg=name)


@pytest.mark.gpu
def test_gpu_the_factor_kernels_launch_on_their_tensors_device():
    """A tensor on another GPU than the current one: the launches follow the tensors."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (the device guard around the launches)")
    b, a = (torch.randn(1, 2, 300, 32, device="cuda:1", requires_grad=True) for _ in range(2))
    got = fla_kernels.fused_log_factors(b, a, None, work=torch.float32, dot=torch.float32)
    want = fla_kernels.log_factors(b, a, None, work=torch.float32, dot=torch.float32)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    got[3].sum().backward()
    assert a.grad.device == a.device and a.grad.isfinite().all()


@pytest.mark.parametrize("installed,want", [(True, "fla"), (False, "torch")])
def test_auto_takes_fla_on_cuda_where_it_is_installed(monkeypatch, installed, want):
    monkeypatch.setattr(dispatch, "fla_installed", lambda: installed)
    for log_space in (True, False):
        assert dispatch.resolve("auto", torch.device("cuda"), log_space=log_space, causal=True) == want
    assert dispatch.resolve("auto", torch.device("cuda"), True, log_space=True, causal=True) == "torch"   # float64


def test_the_retired_triton_backend_is_a_one_line_error_that_names_fla():
    for make in (lambda: LinearAttention(16, 2, backend="triton"),
                 lambda: resolve_backend("triton", "cuda")):
        with pytest.raises(ValueError, match="fla"):
            make()


@pytest.mark.parametrize("installed,device,float64,message", [
    (False, "cuda", False, "pip install 'linattn[gpu]'"),
    (True, "cpu", False, "runs on CUDA tensors, got tensors on cpu"),
    (True, "cuda", True, "for float64 use backend='torch'"),
])
def test_resolve_says_what_the_fla_backend_needs(monkeypatch, installed, device, float64, message):
    monkeypatch.setattr(dispatch, "fla_installed", lambda: installed)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        dispatch.resolve("fla", torch.device(device), float64, log_space=True, causal=True)


def test_the_public_call_refuses_cpu_tensors(monkeypatch):
    monkeypatch.setattr(dispatch, "fla_installed", lambda: True)
    q, k, v = (t.float() for t in features(4, 8, 4, log_space=False))
    with pytest.raises(ValueError, match="backend='fla' runs on CUDA tensors"):
        linear_attention(q, k, v, causal=True, rotary=True, backend="fla")


# ---- on CPU: fla's own kernels in Triton's interpreter ---------------------------------------------

@pytest.fixture
def fla_in_the_interpreter(monkeypatch):
    """fla's real chunk kernels, run by Triton's interpreter.  Two things the interpreter lacks are
    supplied for the test: it makes assigned values tensors but leaves loop indices Python ints, on
    which fla calls .to(tl.int64) (compiled Triton's loop indices are tensors), so loop indices become
    tensors too; and with no driver to time configs, the autotuner keeps each kernel's first."""
    pytest.importorskip("fla", reason="fla's kernels: pip install fla-core (the dev extra does)")
    if CUDA or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs fla in Triton's interpreter (CPU); on a GPU the gpu tests run its kernels")
    from triton.runtime import autotuner, interpreter

    class LoopIndicesAsTensors(interpreter.ASTTransformer):
        def visit_For(self, node):
            self.generic_visit(node)
            if isinstance(node.target, ast.Name):   # `i = i` first in the body: visit_Assign makes it a tensor
                index = ast.Assign(targets=[ast.Name(node.target.id, ast.Store())],
                                   value=ast.Name(node.target.id, ast.Load()))
                node.body.insert(0, self.visit_Assign(index))
            return node
    monkeypatch.setattr(interpreter.FunctionRewriter, "ast_transformer", LoopIndicesAsTensors())
    monkeypatch.setattr(interpreter.InterpretedFunction, "rewritten_fn", {})   # fla's kernels rewritten here only
    monkeypatch.setattr(autotuner.Autotuner, "_bench", lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0])


@pytest.mark.slow
@pytest.mark.parametrize("log_space,m,scale", [(True, 16, 8.0), (False, 16, 0.5)], ids=["log", "plain"])
def test_flas_own_kernels_give_the_torch_backends_outputs_gradients_and_state(fla_in_the_interpreter, log_space,
                                                                              m, scale):
    """Two of fla's 64-token chunks, the values padded to fla's tiles (Dv = 24 -> 32), offset 3: fla's
    kernels in float32 against the torch backend in float64."""
    n, dv = 70, 24
    tensors = [t.detach()[:1].float().requires_grad_()   # 2 heads: fla's (B, T, H, K) layout is exercised
               for t in features(n, m, dv, log_space=log_space, scale=scale)]
    doubles = [t.detach().double().requires_grad_() for t in tensors]
    weights = torch.randn(1, H, n, dv, generator=torch.Generator().manual_seed(1))
    runs = []
    for module, inputs in (("fla", tensors), ("torch", doubles)):
        out, state = call(module, log_space, inputs, offset=3, return_state=True)
        runs.append([out, *torch.autograd.grad((out * weights.to(out.dtype)).sum(), inputs), state.kv, state.k_sum,
                     *([state.log_scale] if log_space else [])])
        assert state.position == n + 3 and (state.log_scale is None) != log_space
    names = ("out", "d q", "d k", "dv", "kv", "k_sum", "log_scale")[:len(runs[1])]
    for name, got, want in zip(names, *runs, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * max(want.abs().max().item(), 1.0),
                                   msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
def test_flas_own_decayed_kernel_gives_the_torch_backends_decay(fla_in_the_interpreter, rotary):
    """chunk_simple_gla with a decay per head over two of fla's chunks, float32, the keys 3 positions
    behind the queries, against the torch backend's decay inside its chunks in float64: output,
    log-normaliser, state and gradients."""
    n, m, dv = 70, 16, 24
    q, k, v = (t.detach()[:1] for t in features(n, m, dv, log_space=False, scale=0.5))
    rate = torch.tensor([-2.0 ** -5, -2.0 ** -6], dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    weights, lse_weights = (torch.randn(1, H, n, *size, dtype=torch.float64, generator=gen) for size in ((dv,), ()))
    runs = []
    for backend, dtype in (("fla", torch.float32), ("torch", torch.float64)):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out, state, lse = call(backend, False, inputs, rotary=rotary, offset=3, key_offset=0, return_state=True,
                               return_log_normalizer=True, log_decay=rate.to(dtype))
        loss = (out * weights.to(dtype)).sum() + (lse * lse_weights.to(dtype)).sum()
        runs.append([out, lse, state.kv, state.k_sum, *torch.autograd.grad(loss, inputs)])
    for name, got, want in zip(("out", "lse", "kv", "k_sum", "d q", "d k", "dv"), *runs, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * max(want.abs().max().item(), 1.0),
                                   msg=name)


# ---- on a GPU: fla's kernels ----------------------------------------------------------------------
# One shape family, the benchmark's (b=1, h=8, Dv=64, bf16): each new (K, V, H, dtype) makes fla autotune
# for about a minute, and its disk cache then serves `python -m benchmarks` on the same machine.

def gpu_inputs(n, m, *, log_space, scale=1.0):
    gen = torch.Generator().manual_seed(0)
    b, a = (torch.randn(1, 8, n, m, generator=gen) * scale for _ in range(2))
    v = torch.randn(1, 8, n, 64, generator=gen)
    q, k = (b, a) if log_space else (b.exp(), a.exp())
    return [t.cuda() for t in (q, k, v)]


def eight_heads(t):
    """(B=2, H=2, N, M) -> (1, 8, N, M) float32 on the GPU."""
    return t.reshape(1, 4, *t.shape[-2:]).repeat(1, 2, 1, 1).float().cuda()


@pytest.mark.gpu
def test_gpu_recurrence_is_fla_chunk_gla_on_this_mapping_with_large_decays(monkeypatch):
    """The CPU tests' stand-in against the kernel it stands for, on the decays FAVOR+ gives at |x| = 30."""
    pytest.importorskip("fla")
    b, a = (eight_heads(t) for t in favor_like(512, 64, 30.0))
    v = torch.randn(1, 8, 512, 64, device="cuda").bfloat16()
    with torch.no_grad():
        got = call("fla", True, [b, a, v], return_state=True)
        def reference(*tensors, return_state):   # the recurrence in (B, H, N, .); fla's layout is (B, N, H, .)
            o, state = recurrent_gla(*(t.transpose(1, 2) for t in tensors), return_state=return_state)
            return o.transpose(1, 2), state
        monkeypatch.setattr(fla_kernels, "gated_linear_attention", reference)
        want = call("fla", True, [b, a, v.float()], return_state=True)
    torch.testing.assert_close(got[0].float(), want[0], rtol=3e-2, atol=3e-2 * want[0].abs().max().item())
    torch.testing.assert_close(got[1].kv, want[1].kv, rtol=3e-2, atol=3e-2 * want[1].kv.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("log_space", [True, False], ids=["log", "plain"])
def test_gpu_fla_backend_in_bf16_matches_the_torch_backend_in_float32(log_space):
    """Log-features stay float32 beside bf16 values (as the FAVOR+ block hands them); plain features
    go to bf16 with the values (as the elu block does under autocast)."""
    pytest.importorskip("fla")
    q, k, v = (t.requires_grad_() for t in gpu_inputs(2048, 64, log_space=log_space))
    halves = [t if log_space and t is not v else t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    weights = torch.randn_like(v)
    runs = []
    for backend, tensors in (("torch", (q, k, v)), ("fla", halves)):
        out = linear_attention(*tensors, causal=True, rotary=True, backend=backend, log_space=log_space)
        runs.append([out.float(), *torch.autograd.grad((out.float() * weights).sum(), tensors)])
    for name, want, got in zip(("out", "d q", "d k", "dv"), *runs):
        torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item(), msg=name)


@pytest.mark.gpu
def test_gpu_fla_backend_keeps_the_past_bitwise_and_is_finite_at_norm_100():
    pytest.importorskip("fla")
    b, a = (eight_heads(t) for t in favor_like(1000, 64, 100.0))
    v = torch.randn(1, 8, 1000, 64, device="cuda").bfloat16()
    out = linear_attention(b, a, v, causal=True, rotary=True, backend="fla", log_space=True)
    assert torch.isfinite(out).all() and (out.abs().amax(-1) > 0).all()
    changed = [t.clone() for t in (b, a, v)]
    for t in changed:
        t[..., 700:, :] = t[..., 700:, :] * 3 - 5
    again = linear_attention(*changed, causal=True, rotary=True, backend="fla", log_space=True)
    assert torch.equal(out[..., :700, :], again[..., :700, :])


@pytest.mark.gpu
@pytest.mark.parametrize("feature_map,num_features", [("favor", 256), ("elu", None)])
def test_gpu_block_with_fla_backend_under_bf16_autocast_matches_torch(feature_map, num_features):
    """The benchmark's blocks (512 wide, 8 heads; FAVOR+ with M=256, elu with M=64)."""
    pytest.importorskip("fla")
    torch.manual_seed(0)
    options = {"num_features": num_features} if num_features else {}
    blocks = [LinearAttention(512, 8, feature_map=feature_map, feature_map_options=options, rope="post",
                              backend=backend).cuda() for backend in ("torch", "fla")]
    blocks[1].load_state_dict(blocks[0].state_dict())
    x = torch.randn(1, 2048, 512, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, got = (block(x).float() for block in blocks)
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("feature_map,window", [("favor", 0), ("favor", 64), ("elu", 0), ("elu", 64)])
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16-autocast"])
def test_gpu_window_and_decay_blocks_on_fla_match_torch(feature_map, window, bf16):
    """The linear part of a window or decay on fla's kernels (bf16 dots under autocast) against the torch
    backend: outputs and the input's gradient."""
    pytest.importorskip("fla")
    torch.manual_seed(0)
    blocks = [LinearAttention(512, 8, feature_map=feature_map, rope="post", window=window, decay="retnet",
                              backend=backend).cuda() for backend in ("torch", "fla")]
    blocks[1].load_state_dict(blocks[0].state_dict())
    x = torch.randn(1, 1024, 512, device="cuda", requires_grad=True)
    runs = []
    for block in blocks:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            out = block(x).float()
        runs.append((out, torch.autograd.grad(out.square().sum(), x)[0]))
    tolerance = 3e-2 if bf16 else 1e-2
    for want, got in zip(*runs):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item())


@pytest.mark.slow
@pytest.mark.parametrize("feature_map", ["favor", "elu"])
def test_compiled_block_on_the_fla_backend_gives_eager_outputs_and_gradients(monkeypatch, feature_map):
    """torch.compile(fullgraph=True) through the custom op, with the stand-in fla on CPU (the device
    check is lifted for the test): outputs and gradients as eager."""
    fake_fla(monkeypatch)
    calls = []
    for module, name in (("fla.ops.gla", "chunk_gla"), ("fla.ops.linear_attn", "chunk_linear_attn")):
        kernel = getattr(sys.modules[module], name)
        monkeypatch.setattr(sys.modules[module], name, lambda *a, kernel=kernel, **kw: calls.append(1) or kernel(*a, **kw))
    resolve = dispatch.resolve
    monkeypatch.setattr(dispatch, "resolve", lambda backend, *args, **kw: "fla" if backend == "fla"
                        else resolve(backend, *args, **kw))
    torch.compiler.reset()
    torch.manual_seed(0)
    options = {"num_features": 8} if feature_map == "favor" else {}
    block = LinearAttention(16, heads=2, feature_map=feature_map, feature_map_options=options, rope="post",
                            backend="fla")
    x = torch.randn(2, 10, 16)
    runs = []
    for model in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        inputs = x.clone().requires_grad_()
        out = model(inputs)
        out.square().sum().backward()
        runs.append([out.detach(), inputs.grad, *(p.grad.clone() for p in block.parameters())])
        block.zero_grad()
    torch.compiler.reset()
    assert len(calls) == 3   # one call a forward: eager, compiled, and the compiled trace
    for want, got in zip(*runs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
