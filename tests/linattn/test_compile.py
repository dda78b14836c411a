"""torch.compile of the linear-attention block: the kernels are custom ops (linattn.custom_ops), so
fullgraph=True works on every backend and gives eager's outputs, gradients and states.

Most cases compile with the "aot_eager" backend: dynamo, the ops' fakes and their autograd formula are
what these tests are about, and inductor's code generation would cost ~20 s per case on 2 CPU cores.
One case (marked slow) runs inductor, the default backend."""
import pytest
import torch

from linattn import LinearAttention
from linattn.custom_ops import linear_attention_op
from linattn.ops.linear_attention.common import LogProjection
from linattn.rotary import phases_op


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles new blocks: without a reset, the shared forward's cache fills and dynamo
    would fall back to eager after a few recompilations."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def _block(feature_map: str, rope: str, backend: str, causal: bool = True) -> LinearAttention:
    options = {"num_features": 8} if feature_map == "favor" else {}
    return LinearAttention(16, heads=2, feature_map=feature_map, rope=rope, causal=causal, backend=backend,
                           chunk_size=4, feature_map_options=options)


def _outputs_and_gradients(model, run, x):
    x = x.clone().requires_grad_()
    outs = run(x)
    sum((out * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum() for out in outs).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return [out.detach() for out in outs], x.grad, grads


def _assert_compiled_matches_eager(model, x, compiler="aot_eager", rtol=1e-5, atol=1e-6):
    eager = _outputs_and_gradients(model, model, x)
    compiled = _outputs_and_gradients(model, torch.compile(model, fullgraph=True, backend=compiler), x)
    for name, got, want in zip(model.names, compiled[0], eager[0]):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(compiled[1], eager[1], rtol=rtol, atol=atol)
    for name in eager[2]:
        torch.testing.assert_close(compiled[2][name], eager[2][name], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


class Blocks(torch.nn.Module):
    """Several blocks on one input, compiled as one graph (one compilation instead of one per case:
    each costs seconds on CPU).  `cases`: (feature map, rope, backend, causal, input scale)."""

    def __init__(self, cases):
        super().__init__()
        self.names = [f"{fm}-{rope}-{backend}-{'causal' if causal else 'full'}-x{scale}"
                      for fm, rope, backend, causal, scale in cases]
        self.blocks = torch.nn.ModuleList(_block(fm, rope, backend, causal) for fm, rope, backend, causal, _ in cases)
        self.scales = [scale for *_, scale in cases]

    def forward(self, x):
        return [block(x * scale) for block, scale in zip(self.blocks, self.scales)]


# favor takes the log-space path (the cpp kernel or torch_logspace.py's ops), elu the plain one; every
# placement appears on the log-space path, each backend on two; scale 30 makes running maxima jump
# inside chunks, so the op runs the exact rows' branch too.  Kept to six: compile time grows with them.
CASES = [("favor", "post", "cpp", True, 2), ("favor", "pre", "torch", True, 2), ("favor", "none", "cpp", True, 2),
         ("favor", "post", "torch", False, 1), ("elu", "post", "torch", True, 2), ("favor", "post", "cpp", True, 30)]


@pytest.mark.slow
def test_compiled_blocks_give_eager_outputs_and_gradients():
    """Every placement, favor and elu, torch and cpp backends, causal and not, a ragged last chunk
    (10 tokens in chunks of 4), in training mode: one fullgraph compilation of all of them."""
    _assert_compiled_matches_eager(Blocks(CASES), torch.randn(2, 10, 16))


class WindowDecayBlocks(torch.nn.Module):
    """A window with a decay on the log-space path (favor, `post`: two op calls) and the plain one (elu),
    on the auto backend, which resolves to the cpp kernel for favor when it runs."""
    names = ["favor-post-window-decay", "elu-pre-window-decay"]

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            LinearAttention(16, heads=2, feature_map=fm, rope=rope, chunk_size=4, window=3, decay="retnet",
                            feature_map_options={"num_features": 8} if fm == "favor" else {})
            for fm, rope in (("favor", "post"), ("elu", "pre")))

    def forward(self, x):
        return [block(x) for block in self.blocks]


@pytest.mark.slow
def test_compiled_window_and_decay_blocks_give_eager_outputs_and_gradients():
    _assert_compiled_matches_eager(WindowDecayBlocks(), torch.randn(2, 10, 16))


@pytest.mark.slow
def test_compiled_prefill_returns_eager_state_and_future_outputs_do_not_change_the_past():
    blocks = [_block(feature_map, "post", "auto").eval() for feature_map in ("favor", "elu")]

    def prefill(x):
        return [block(x, return_state=True) for block in blocks]

    compiled = torch.compile(prefill, fullgraph=True, backend="aot_eager")
    x = torch.randn(1, 9, 16)
    later = x.clone()
    later[:, 6:] *= 100
    with torch.no_grad():
        results, eager_results, changed = compiled(x), prefill(x), compiled(later)
    for block, (out, state), (eager_out, eager_state), (changed_out, _) in zip(blocks, results, eager_results,
                                                                            changed):
        torch.testing.assert_close(out, eager_out)
        assert state.position == eager_state.position == 9
        assert (state.log_scale is None) == (eager_state.log_scale is None)
        for got, want in zip(state[:2] + state[3:], eager_state[:2] + eager_state[3:]):
            torch.testing.assert_close(got, want)
        assert torch.equal(changed_out[:, :6], out[:, :6])
        step_out, _ = block.step(x[:, -1], block(x[:, :-1], return_state=True)[1])
        torch.testing.assert_close(step_out, out[:, -1], rtol=1e-4, atol=1e-5)
    assert results[0][1].log_scale is not None and results[1][1].log_scale is None


def test_compiled_op_gives_nan_for_negative_features_or_in_debug_mode_refuses_them():
    """The data's guards and (in debug mode) checks run inside the op, as in eager mode."""
    import linattn
    from linattn.functional import linear_attention
    phi = torch.rand(1, 1, 4, 2) - 0.5
    phi[0, 0, 0] = -1
    compiled = torch.compile(lambda q, k, v: linear_attention(q, k, v, causal=True, rotary=False),
                             fullgraph=True, backend="aot_eager")
    assert compiled(phi, phi, torch.randn(1, 1, 4, 3)).isnan().all()
    linattn.set_debug(True)
    try:
        with pytest.raises(ValueError, match="negative entries"):
            compiled(phi, phi, torch.randn(1, 1, 4, 3))
    finally:
        linattn.set_debug(False)


@pytest.mark.slow
def test_compiled_block_with_inductor():
    """The default compiler (inductor) around the op: a ragged last chunk, cpp kernel, training."""
    _assert_compiled_matches_eager(Blocks([("favor", "post", "cpp", True, 2)]), torch.randn(2, 10, 16),
                                   compiler="inductor")


def _op_arguments(backend: str, projected: bool, return_state: bool):
    q, k = torch.randn(2, 1, 6, 4), torch.randn(2, 1, 6, 4)
    v = torch.randn(2, 1, 6, 3)
    if projected:
        weight = torch.randn(8, 4)
        q_parts = (q, weight, torch.randn(2, 1, 6, 1), 0.0, -0.25)
        k_parts = (k, weight, None, -1.0, -0.25)
    else:
        q_parts, k_parts = (q, None, None, 0.0, 0.0), (k, None, None, 0.0, 0.0)
    for t in (*q_parts, *k_parts, v):
        if isinstance(t, torch.Tensor):
            t.requires_grad_()
    return (*q_parts, *k_parts, v, True, True, 3, 4, 10000.0, return_state, backend, True, True)


@pytest.mark.parametrize("backend,projected", [("torch", False), ("torch", True), ("cpp", False), ("cpp", True)])
def test_custom_op_registration(backend, projected):
    """torch.library.opcheck: schema, fake shapes and dtypes against the real op, and its autograd
    registration.  (The fla backend goes through the same op: its test is
    tests/linattn/ops/linear_attention/test_fla_kernels.py's
    test_compiled_block_on_the_fla_backend_gives_eager_outputs_and_gradients.)"""
    torch.library.opcheck(linear_attention_op, _op_arguments(backend, projected, return_state=True))


def test_rotary_phases_op_registration():
    torch.library.opcheck(phases_op, (5, 8, 7, 10000.0, torch.device("cpu"), False))


def test_projection_gradients_through_the_op_match_eager():
    """A LogProjection's weight and shift take their gradients through the backward op."""
    from linattn.functional import linear_attention

    def attend(inputs, weight, shift, v):
        projection = LogProjection(inputs, weight, shift, -0.25)
        return linear_attention(projection, projection, v, causal=True, rotary=True, log_space=True, chunk_size=4)

    leaves = [torch.randn(1, 2, 7, 4), torch.randn(6, 4), torch.randn(1, 2, 7, 1), torch.randn(1, 2, 7, 3)]
    results = []
    for run in (attend, torch.compile(attend, fullgraph=True, backend="aot_eager")):
        inputs = [t.clone().requires_grad_() for t in leaves]
        out = run(*inputs)
        out.square().sum().backward()
        results.append((out.detach(), [t.grad for t in inputs]))
    torch.testing.assert_close(results[1][0], results[0][0])
    for got, want in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_gpu_compiled_block_with_inductor_and_bf16_autocast():
    """On CUDA: the fla backend inside an inductor graph, fp32 and under bf16 autocast."""
    pytest.importorskip("fla")
    model = Blocks([("favor", "post", "fla", True, 1), ("elu", "post", "fla", True, 1)]).cuda()
    x = torch.randn(2, 300, 16, device="cuda")
    _assert_compiled_matches_eager(model, x, compiler="inductor", rtol=1e-4, atol=1e-5)   # TF32 matmuls
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager, compiled = model(x), torch.compile(model, fullgraph=True)(x)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("feature_map", ["favor", "elu"])
def test_compiled_state_carries_no_gradient_as_in_eager(feature_map: str) -> None:
    """A prefill's state is for decoding: eager detaches it, and so does the compiled op (its autograd
    formula would otherwise hand a loss on the state zero gradients without a word)."""
    torch.manual_seed(0)
    block = LinearAttention(16, 2, feature_map=feature_map, rope="post", backend="torch")
    x = torch.randn(1, 9, 16, requires_grad=True)
    compiled = torch.compile(lambda x: block(x, return_state=True), fullgraph=True, backend="aot_eager")
    for run in (lambda x: block(x, return_state=True), compiled):
        out, state = run(x)
        assert out.requires_grad and not state.kv.requires_grad and not state.k_sum.requires_grad


def test_the_compiled_backward_does_not_check_the_log_range_again(monkeypatch) -> None:
    """In debug mode the forward op checks the log-features' range (a read of the data and a sync);
    the backward op runs the computation again on the same features and skips it."""
    import linattn
    from linattn.ops.linear_attention import common
    calls = []
    check = common.check_log_feature_range
    monkeypatch.setattr(common, "check_log_feature_range", lambda *args: (calls.append(1), check(*args))[1])
    linattn.set_debug(True)
    try:
        block = torch.compile(_block("favor", "post", "torch"), fullgraph=True, backend="aot_eager")
        x = torch.randn(2, 9, 16, requires_grad=True)
        out = block(x)
        assert len(calls) == 1
        out.square().sum().backward()
        assert len(calls) == 1 and x.grad.abs().sum() > 0
    finally:
        linattn.set_debug(False)
