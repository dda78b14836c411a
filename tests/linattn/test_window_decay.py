"""LinearAttention's window= and decay=: outputs against explicit N x N float64 weights for every map and
placement, decoding against the parallel pass, gradients by gradcheck, the defaults unchanged, bad input."""
import pytest
import torch
from torch.func import functional_call

import linattn

from benchmarks.timing import kept_for_backward
from linattn import LinearAttention, LinearState, SoftmaxAttention
from linattn.feature_maps import FeatureMap
from linattn.functional import softmax_attention_reference
from linattn.ops.window_decay import WindowState, window_decay_reference
from linattn.rotary import apply_rotary
from tests.conftest import LIBRARY_MAPS

PLACEMENTS = ("post", "pre", "none")
OPTIONS = {"favor": {"num_features": 16}, "taylor": {"dim": 4}}   # taylor: M = 1 + 4 + 10, padded to 16
SETTINGS = [(w, d) for w in (0, 1, 8, 64, 200) for d in (None, "retnet") if w or d]   # N = 80 < 200


def block(fm, rope, window, decay, dim=16, heads=2, chunk_size=8, **kw):
    torch.manual_seed(0)
    b = LinearAttention(dim, heads, feature_map=fm, rope=rope, window=window, decay=decay, chunk_size=chunk_size,
                        feature_map_options=OPTIONS.get(fm, {}), **kw).double().eval()
    if window:
        with torch.no_grad():
            b.window_log_gain.normal_()   # a gain away from 1, so that its place in the formula is tested
    return b


def reference(b, q, k, v, offset):
    """window_decay_reference on the block's own features: s from RoPE(q), RoPE(k) (q, k for none)."""
    q_hat, k_hat = (apply_rotary(q, offset=offset), apply_rotary(k, offset=offset)) if b.rope != "none" else (q, k)
    mapped_q, mapped_k = (q_hat, k_hat) if b.rope == "pre" else (q, k)
    fm = b.feature_map
    features = fm.log_features if fm.log_space else fm
    return window_decay_reference(q_hat, k_hat, features(mapped_q, is_query=True), features(mapped_k, is_query=False),
                                  v, window=b.window, log_decay=b.log_decay if b.decay else None,
                                  log_gain=b.window_log_gain if b.window else None, rotary=b.rope == "post",
                                  log_space=fm.log_space, offset=offset)


@pytest.mark.parametrize("window, decay", SETTINGS)
@pytest.mark.parametrize("rope", PLACEMENTS)
@pytest.mark.parametrize("fm", LIBRARY_MAPS)
def test_matches_explicit_weights(fm, rope, window, decay):
    b = block(fm, rope, window, decay)
    q, k, v = (torch.randn(1, 2, 80, 8, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(b.attend(q, k, v, offset=3), reference(b, q, k, v, 3), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("fm, rope", [("favor", "post"), ("elu", "pre")])
def test_strong_decay_across_long_chunks(fm, rope, backend):
    """gamma = 0.05 over chunks of 64: the folded log-features jump far within a chunk (the op's exact rows)."""
    b = block(fm, rope, 8, (0.05, 0.999), chunk_size=64, backend=backend)
    q, k, v = (torch.randn(1, 2, 80, 8, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(b.attend(q, k, v), reference(b, q, k, v, 0), rtol=1e-9, atol=1e-10)


def test_window_past_the_sequence_is_softmax_attention():
    b = block("favor", "post", 200, None)
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64) for _ in range(3))
    expected = softmax_attention_reference(apply_rotary(q), apply_rotary(k), v, causal=True)
    torch.testing.assert_close(b.attend(q, k, v), expected)


@pytest.mark.parametrize("fm, rope", [("favor", "pre"), ("favor", "post"), ("softmax", "none"), ("elu", "pre")])
def test_float32_at_large_scale_is_finite_and_matches_float64(fm, rope):
    """Scores around 1e3: e^s alone overflows even float64; the shared stabiliser keeps every term <= 1."""
    b = block(fm, rope, 8, "retnet")
    q, k, v = (torch.randn(1, 2, 64, 8, dtype=torch.float64) * s for s in (30, 30, 1))
    exact = b.attend(q, k, v)
    single = b.float().attend(q.float(), k.float(), v.float())
    assert torch.isfinite(exact).all() and torch.isfinite(single).all()
    torch.testing.assert_close(single.double(), exact, rtol=1e-3, atol=1e-3)


DECODING = [(fm, rope) for fm in ("elu", "favor") for rope in PLACEMENTS] + [
    ("taylor", "pre"), ("hedgehog", "post"), ("softmax", "none")]


@pytest.mark.parametrize("window, decay", [(1, None), (6, "retnet"), (0, (0.5, 0.9)), (30, None)])
@pytest.mark.parametrize("fm, rope", DECODING)
def test_decoding_matches_parallel_pass(fm, rope, window, decay):
    b = block(fm, rope, window, decay)
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    full = b(x)
    prefix, state = b(x[:, :9], return_state=True)
    assert isinstance(state, WindowState) and state.keys.shape[-2] == min(window, 9)
    outs, fresh = [prefix], None
    for t in range(20):
        y, fresh = b.step(x[:, t], fresh)
        torch.testing.assert_close(y, full[:, t], rtol=1e-9, atol=1e-10)
        if t >= 9:
            y, state = b.step(x[:, t], state)
            outs.append(y[:, None])
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-9, atol=1e-10)
    assert fresh.keys.shape[-2] == min(window, 20) and fresh.position == state.position == 20


@pytest.mark.parametrize("fm, rope, window, decay", [
    ("elu", "post", 3, (0.9, 0.6)), ("favor", "post", 3, (0.9, 0.6)), ("favor", "pre", 2, None),
    ("taylor", "none", 0, "retnet")])
def test_gradients_by_gradcheck(fm, rope, window, decay):
    options = {"favor": {"num_features": 8}, "taylor": {"dim": 2}}
    b = LinearAttention(8, 2, feature_map=fm, rope=rope, window=window, decay=decay, chunk_size=4,
                        feature_map_options=options.get(fm, {})).double().eval()
    x = torch.randn(1, 7, 8, dtype=torch.float64, requires_grad=True)
    if not window:
        assert torch.autograd.gradcheck(lambda x: b(x, offset=2), (x,))
        return
    gain = torch.randn(2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, g: functional_call(b, {"window_log_gain": g}, (x,), {"offset": 2}),
                                    (x, gain))


@pytest.mark.parametrize("fm", ["favor", "elu"])
def test_defaults_are_todays_block(fm):
    today = block(fm, "post", 0, None)
    default = LinearAttention(16, 2, feature_map=fm, rope="post", chunk_size=8,
                              feature_map_options=OPTIONS.get(fm, {})).double().eval()
    default.load_state_dict(today.state_dict())
    assert today.state_dict().keys() == default.state_dict().keys()
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    assert torch.equal(today(x), default(x))
    assert isinstance(today.step(x[:, 0])[1], LinearState)


@pytest.mark.parametrize("options, word", [
    ({"window": -1}, "window"), ({"window": 2.5}, "window"), ({"window": True}, "window"),
    ({"decay": "exponential"}, "decay"), ({"decay": [0.5]}, "decay"), ({"decay": [0.0, 0.5]}, "decay"),
    ({"decay": [0.5, 1.5]}, "decay"), ({"decay": 0.5}, "decay"), ({"decay": [0.5, float("nan")]}, "decay"),
    ({"window": 4, "causal": False}, "causal"), ({"decay": "retnet", "causal": False}, "causal")])
def test_bad_options(options, word):
    with pytest.raises(ValueError, match=word):
        LinearAttention(16, 2, **options)


def test_step_takes_its_own_state():
    b = block("favor", "pre", 4, None)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    _, linear_state = LinearAttention(16, 2).double()(x, return_state=True)
    with pytest.raises(ValueError, match="WindowState"):
        b.step(x[:, 0], linear_state)
    _, state = b(x, return_state=True)
    with pytest.raises(ValueError, match="state.keys"):
        b.step(x[:, 0], state._replace(keys=state.keys[:, :1]))
    assert state.linear is not None   # 5 tokens, a window of 4: one key is in the linear state
    with pytest.raises(ValueError, match="kv"):
        b.step(x[:, 0], state._replace(linear=state.linear._replace(kv=state.linear.kv[..., :1])))
    with pytest.raises(ValueError, match="LinearState"):
        b.step(x[:, 0], state._replace(linear=state.keys))
    with pytest.raises(ValueError, match="log_space"):
        b.step(x[:, 0], state._replace(linear=state.linear._replace(log_scale=None)))


@pytest.mark.parametrize("fm", ["elu", "taylor"])
def test_plain_maps_read_nothing_back_from_the_tensors(fm, monkeypatch):
    """No .item() or bool(tensor) in forward, backward or a step (the log-space maps' reads are the op's)."""
    b = LinearAttention(16, 2, feature_map=fm, rope="post", window=4, decay="retnet",
                        feature_map_options=OPTIONS.get(fm, {}))
    x = torch.randn(2, 40, 16)
    reads = []
    item, boolean = torch.Tensor.item, torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append("item") or item(t))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append("bool") or boolean(t))
    b(x).sum().backward()
    _, state = b(x, return_state=True)
    b.step(x[:, 0], state)
    assert reads == []


def test_eq19_query_parts_are_recomputed_in_backward():
    """`post` with a window splits R_W e^b into two non-negative parts through four logaddexps over half
    the features; backward recomputes them from b rather than keep their inputs (190 MiB at N = 8192)."""
    b = LinearAttention(16, 2, feature_map="favor", rope="post", window=4, feature_map_options={"num_features": 32})
    x = torch.randn(1, 40, 16, requires_grad=True)
    halves = 1 * 2 * 36 * 16   # B x H x (N - W) x M / 2: one coordinate of each pair, for the linear part's queries
    assert not [t for t in kept_for_backward(lambda: b(x)) if t.is_floating_point() and t.numel() == halves]


def states_of(x, **options):
    b = LinearAttention(16, 2, **options)
    return b, b(x, return_state=True)[1]


@pytest.mark.parametrize("made, taking", [
    ({"window": 8}, {"window": 4}), ({"window": 4}, {"window": 8}),
    ({"decay": "retnet"}, {"window": 4, "decay": "retnet"}),
    ({"window": 4, "decay": "retnet"}, {"decay": "retnet"}), ({"window": 4}, {"window": 4, "decay": "retnet"}),
    ({"window": 4, "feature_map": "elu"}, {"window": 4, "feature_map": "hedgehog"})])
def test_step_refuses_another_blocks_state(made, taking):
    """Issue 49: a state records the window, decay and map it was made for (once 25% off, silently)."""
    x = torch.randn(1, 12, 16)
    _, state = states_of(x, **made)
    b, _ = states_of(x, **taking)
    with pytest.raises(ValueError, match="made for a block"):
        b.step(x[:, 0], state)


@pytest.mark.parametrize("change, word", [
    (lambda s, short: s._replace(keys=torch.cat((s.keys, s.keys[:, :, :1]), 2)), "state.keys"),   # longer than W
    (lambda s, short: short._replace(linear=s.linear), "linear state"),     # a short cache beside a linear state
    (lambda s, short: short._replace(keys=s.keys), "state.keys"),          # a cache longer than its position
    (lambda s, short: s._replace(position=2 ** 63), "position"),
    (lambda s, short: s._replace(linear=s.linear._replace(position=3)), "state.linear is at")])
def test_step_refuses_a_state_that_does_not_fit_its_position(change, word):
    x = torch.randn(1, 12, 16)
    b, state = states_of(x, window=4, decay="retnet")
    _, short = b(x[:, :2], return_state=True)
    with pytest.raises(ValueError, match=word):
        b.step(x[:, 0], change(state, short))


@pytest.mark.parametrize("name, value", [("window", 4), ("window", 0), ("decay", "retnet"), ("decay", None)])
def test_window_and_decay_are_fixed_at_construction(name, value):
    b = LinearAttention(16, 2, window=4 if value == 0 else 0, decay="retnet" if value is None else None)
    with pytest.raises(AttributeError, match="fixed at construction"):
        setattr(b, name, value)


@pytest.mark.parametrize("decay", [{0.5: 1, 0.9: 1}, {0.5, 0.9}, iter([0.5, 0.9]), "RetNet"])
def test_decay_takes_a_sequence_of_numbers(decay):
    with pytest.raises(ValueError, match="decay"):
        LinearAttention(16, 2, decay=decay)


class Shifted(FeatureMap):
    """Features that turn negative once `shift` is set, after the block checked the map."""
    shift = 0.0

    def forward(self, x, *, is_query):
        return torch.relu(x) - self.shift


@pytest.fixture
def debug():
    linattn.set_debug(True)
    yield
    linattn.set_debug(False)


@pytest.mark.parametrize("window, decay", [(4, None), (0, "retnet"), (4, "retnet")])
def test_negative_plain_features_give_nan_or_are_refused_in_debug_mode(window, decay):
    """Issue 49: the window and decay path bypassed the op's guard (finite outputs, debug mode silent)."""
    b = LinearAttention(16, 2, feature_map=Shifted(8), rope="none", window=window, decay=decay)
    b.feature_map.shift = 0.01
    x = torch.randn(1, 12, 16)
    assert b(x).isnan().all()


@pytest.mark.parametrize("window, decay", [(4, None), (0, "retnet"), (4, "retnet")])
def test_debug_mode_refuses_negative_plain_features_on_every_path(window, decay, debug):
    b = LinearAttention(16, 2, feature_map=Shifted(8), rope="none", window=window, decay=decay)
    b.feature_map.shift = 0.01
    x = torch.randn(1, 12, 16)
    with pytest.raises(ValueError, match="negative"):
        b(x)
    with pytest.raises(ValueError, match="negative"):
        b.step(x[:, 0])


@pytest.mark.parametrize("make", [lambda: LinearAttention(16, 2, window=4),
                                  lambda: LinearAttention(16, 2, decay="retnet"),
                                  lambda: LinearAttention(16, 2, feature_map="elu"),
                                  lambda: SoftmaxAttention(16, 2, window=3)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_debug_mode_flags_non_finite_inputs_to_any_block(make, bad, debug):
    b, x = make(), torch.randn(1, 6, 16)
    x[0, 2, 3] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        b(x)
    with pytest.raises(ValueError, match="NaN or inf"):
        b.step(x[:, 2])


@pytest.mark.parametrize("field", ["keys", "values", "features"])
def test_debug_mode_flags_nan_in_a_window_cache(field, debug):
    b = LinearAttention(16, 2, window=4)
    x = torch.randn(1, 6, 16)
    _, state = b(x, return_state=True)
    damaged = state._replace(**{field: torch.full_like(getattr(state, field), float("nan"))})
    with pytest.raises(ValueError, match=f"state.{field}"):
        b.step(x[:, 0], damaged)


@pytest.mark.parametrize("options", [{"decay": "retnet"}, {"window": 4}, {"window": 4, "decay": "retnet"}])
def test_favor_beyond_its_range_gives_nan_not_uniform_weights(options):
    """Issue 49: at x1e20 |x|^2 overflows and every log-feature is -inf; the guard lifted them to its floor,
    which gave uniform weights, finite and wrong (without decay the op's bound made them NaN)."""
    b = LinearAttention(32, 2, **options)
    x = torch.randn(1, 10, 32) * 1e20
    assert b(x).isnan().all()
    state, outs = None, []
    for t in range(10):
        out, state = b.step(x[:, t], state)
        outs.append(out)
    assert torch.stack(outs, 1).isnan().all()


@pytest.mark.parametrize("fm", ["elu", "favor"])
def test_rows_among_the_first_w_are_never_exactly_zero(fm):
    """Issue 49: at inputs of 1e18 a window's scores reach -1e36, below the -1e30 once padded in for rows
    with no linear key, which then took all the weight: exactly 0.  Now the window's rows, or NaN."""
    b = LinearAttention(16, 2, feature_map=fm, window=4)
    q, k, v = (torch.randn(1, 2, 10, 8) * 1e18 for _ in range(3))
    with torch.no_grad():
        out = b.attend(q, k, v)
    assert not (out == 0).all(-1).any()
