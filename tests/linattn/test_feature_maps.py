"""Feature maps: the registry, FAVOR+ against exact softmax and against performer-pytorch, redraws,
and numerics for large inputs."""
import io
import re
import warnings
from functools import partial
from unittest import mock

import pytest
import torch

import linattn
from linattn import FavorFeatureMap, FeatureMap, LinearAttention, make_feature_map, register_feature_map
from linattn.feature_maps import FEATURE_MAPS, feature_map_options
from linattn.functional import linear_attention, softmax_attention_reference
from tests.conftest import LIBRARY_MAPS

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import performer_pytorch.performer_pytorch as performer


def test_registry_lists_the_three_maps_and_builds_them_by_name():
    assert {"elu", "favor", "softmax"} <= set(linattn.available_feature_maps())
    assert make_feature_map("favor", 64).num_features == 256          # default M = 4 D
    assert make_feature_map("favor", 64, options={"num_features": 100}).projection.shape == (100, 64)
    assert make_feature_map("elu", 32).num_features == 32


def test_options_given_as_keywords_are_refused_with_the_dict_form():
    with pytest.raises(ValueError, match=r"options=\{'num_features': 100\}"):
        make_feature_map("favor", 64, num_features=100)


def test_unknown_feature_map_lists_registered_ones():
    with pytest.raises(ValueError, match="unknown feature map 'relu2'.*elu, favor"):
        make_feature_map("relu2", 16)
    with pytest.raises(ValueError, match=r"unknown feature map"):
        LinearAttention(32, 2, feature_map="nope")


@pytest.mark.parametrize("options, message", [
    (dict(num_features=32.0), "num_features must be a positive integer, got 32.0"),
    (dict(seed=1e300), "seed must be an integer in [0, 2**63) (what a checkpoint can restore), got 1e+300"),
    (dict(seed=True), "seed must be an integer in [0, 2**63) (what a checkpoint can restore), got True"),
    (dict(seed=-1), "seed must be an integer in [0, 2**63) (what a checkpoint can restore), got -1"),
    (dict(seed=2**63), "seed must be an integer in"),
])
def test_favor_counts_and_seeds_must_be_integers(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_feature_map("favor", 16, options=options)


@pytest.mark.parametrize("name, heads", [("favor", None), ("hedgehog", 4)])
def test_a_feature_count_whose_weights_cannot_fit_is_refused_before_allocation(name, heads):
    """num_features=10**12 allocated until the process was killed."""
    with pytest.raises(ValueError, match="smaller num_features"):
        make_feature_map(name, 64, heads=heads, options={"num_features": 10**12})


def test_unknown_option_names_accepted_ones():
    with pytest.raises(ValueError, match=r"does not take option\(s\) \['num_features'\]"):
        make_feature_map("elu", 16, options={"num_features": 8})


def test_user_registered_map_is_selectable_by_name():
    @register_feature_map("test-relu")
    class ReluFeatureMap(FeatureMap):
        def forward(self, x, *, is_query):
            return torch.relu(x) + 1e-3

    try:
        block = LinearAttention(32, 4, feature_map="test-relu", rope="post")
        assert isinstance(block.feature_map, ReluFeatureMap)
        assert block(torch.randn(2, 9, 32)).shape == (2, 9, 32)
    finally:
        del FEATURE_MAPS["test-relu"]


def test_registering_a_taken_name_for_another_class_fails():
    with pytest.raises(ValueError, match="already registered"):
        register_feature_map("favor")(type("Other", (FeatureMap,), {}))


@pytest.mark.parametrize("name", ["", 3, None, "two words"])
def test_registering_under_a_name_that_is_not_one_word_fails_at_once(name):
    with pytest.raises(ValueError, match=rf"without spaces, such as 'relu', got {name!r}$"):
        register_feature_map(name)
    assert name not in FEATURE_MAPS


@pytest.mark.parametrize("cls", [int, torch.nn.Linear, FeatureMap(4), "elu"], ids=["int", "module", "instance", "str"])
def test_registering_something_that_is_not_a_feature_map_class_fails(cls):
    """It used to be accepted, and a block asking for it by name then failed with an AttributeError."""
    with pytest.raises(ValueError, match="registers FeatureMap subclasses"):
        register_feature_map("zz")(cls)
    assert "zz" not in FEATURE_MAPS


@pytest.mark.parametrize("name, heads", [("elu", None), ("favor", None), ("hedgehog", 2), ("taylor", 2)])
def test_a_head_dim_that_is_not_an_integer_is_named_in_the_error(name, heads):
    """8.0 was blamed on an option nobody gave (hedgehog: num_features 16.0) or got through (elu)."""
    with pytest.raises(ValueError, match=r"^head_dim must be a positive integer, got 8.0$"):
        make_feature_map(name, 8.0, heads=heads)
    with pytest.raises(ValueError, match=r"^head_dim must be a positive integer, got 8.0$"):
        linattn.feature_map_class(name)(8.0, **({} if heads is None else {"heads": heads}))


@pytest.mark.parametrize("name", ["elu", "favor", "softmax"])
def test_features_are_non_negative_with_expected_shape(name):
    fm = make_feature_map(name, 16)
    x = torch.randn(2, 3, 7, 16) * 3
    for is_query in (True, False):
        phi = fm(x, is_query=is_query)
        assert phi.shape == (2, 3, 7, fm.num_features) and (phi >= 0).all()


def test_softmax_map_is_shen_et_al():
    fm = make_feature_map("softmax", 8)
    x = torch.randn(1, 1, 5, 8)
    torch.testing.assert_close(fm(x, is_query=True), x.softmax(-1))
    torch.testing.assert_close(fm(x, is_query=False), x.exp())


def test_favor_is_unbiased_estimate_of_softmax_kernel():
    """E[phi(q).phi(k)] = exp(q.k / sqrt(D)) up to the exact stabilisers, checked on keys only
    (queries carry a per-row constant): phi_k(k) * exp(ceiling) * sqrt(M) = exp(w.x - |x|^2/2)."""
    fm = FavorFeatureMap(8, num_features=16, seed=3)
    k = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    x = k * 8 ** -0.25
    w = fm.projection.double()
    expected = torch.exp(x @ w.T - x.square().sum(-1, keepdim=True) / 2) / 4
    ceiling = (w.square().sum(-1).amax() / 2 - fm.KEY_LOGIT_CEILING).clamp_min(0)
    torch.testing.assert_close(fm.double()(k, is_query=False) * ceiling.exp(), expected)


def _favor_vs_softmax_error(num_features: int, seeds=range(4)) -> float:
    q, k = (torch.randn(1, 4, 64, 16, dtype=torch.float64) * 0.7 for _ in range(2))
    v = torch.randn(1, 4, 64, 16, dtype=torch.float64)
    exact = softmax_attention_reference(q, k, v, causal=False)
    errors = []
    for seed in seeds:
        fm = FavorFeatureMap(16, num_features=num_features, seed=seed).double()
        approx = linear_attention(fm(q, is_query=True), fm(k, is_query=False), v, causal=False, rotary=False)
        errors.append((approx - exact).pow(2).mean().sqrt())
    return float(torch.stack(errors).mean())


def test_favor_approximates_softmax_better_with_more_features():
    errors = [_favor_vs_softmax_error(m) for m in (16, 64, 256, 1024)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    # The kernel estimate is unbiased with error ~1/sqrt(M) but heavy-tailed; after the ratio of
    # numerator and denominator, measured here: 0.127, 0.086, 0.064, 0.051.
    assert errors[-1] < 0.5 * errors[0], errors
    assert errors[-1] < 0.08, errors


def test_agrees_with_performer_pytorch_fast_attention():
    """Non-causal FastAttention given our projection.  performer-pytorch adds eps=1e-4 to every
    feature (a different estimator where features are << 1), so it is patched to 0 here; its other
    stabilisers are per-query and whole-sequence constants, which cancel."""
    with mock.patch("sys.stdout", new_callable=io.StringIO):
        peer = performer.FastAttention(dim_heads=32, nb_features=128, causal=False)
    fm = FavorFeatureMap(32, num_features=128, seed=7)
    peer.projection_matrix.copy_(fm.projection)
    q, k, v = (torch.randn(2, 4, 50, 32) for _ in range(3))
    ours = linear_attention(fm(q, is_query=True), fm(k, is_query=False), v, causal=False, rotary=False)
    with mock.patch.object(performer, "softmax_kernel", partial(performer.softmax_kernel, eps=0.0)):
        theirs = peer(q, k, v)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_performer_causal_key_stabiliser_leaks_the_future_ours_does_not():
    """performer-pytorch subtracts a max over all keys and adds eps, so a large future key
    changes past outputs; our key shift depends on the projection only."""
    fm = FavorFeatureMap(16, num_features=64, seed=0)
    q, k, v = (torch.randn(1, 2, 12, 16) for _ in range(3))
    k_future = k.clone()
    k_future[:, :, -1] *= 8
    theirs = [performer.causal_linear_attention_noncuda(
        performer.softmax_kernel(q, projection_matrix=fm.projection, is_query=True),
        performer.softmax_kernel(kk, projection_matrix=fm.projection, is_query=False), v) for kk in (k, k_future)]
    ours = [linear_attention(fm(q, is_query=True), fm(kk, is_query=False), v, causal=True, rotary=True)
            for kk in (k, k_future)]
    assert (theirs[0][:, :, :-1] - theirs[1][:, :, :-1]).abs().max() > 1e-3
    assert torch.equal(ours[0][:, :, :-1], ours[1][:, :, :-1])


def test_favor_redraws_every_k_training_calls_reproducibly_and_never_in_eval():
    fm = FavorFeatureMap(8, num_features=16, redraw_interval=3, seed=11)
    first = fm.projection.clone()
    x = torch.randn(1, 1, 4, 8)
    for _ in range(2):
        fm(x, is_query=True)
        fm(x, is_query=False)            # keys do not count: one call per attention pass
    assert torch.equal(fm.projection, first)
    fm(x, is_query=True)                  # third training pass: redraw
    assert not torch.equal(fm.projection, first) and fm.draws == 1
    twin = FavorFeatureMap(8, num_features=16, redraw_interval=3, seed=11)
    twin.redraw()
    assert torch.equal(twin.projection, fm.projection)   # draw r depends on (seed, r) only
    fm.eval()
    for _ in range(10):
        fm(x, is_query=True)
    assert fm.draws == 1
    assert not torch.equal(FavorFeatureMap(8, num_features=16, seed=12).projection, first)


def test_favor_projection_is_block_orthogonal_with_chi_norms():
    fm = FavorFeatureMap(16, num_features=32, seed=5)
    directions = fm.projection / fm.projection.norm(dim=-1, keepdim=True)
    block = directions[:16] @ directions[:16].T
    torch.testing.assert_close(block, torch.eye(16), atol=1e-5, rtol=0)
    assert fm.projection.norm(dim=-1).std() > 0.1       # chi norms, not all sqrt(D)


def test_favor_seed_defaults_follow_torch_manual_seed_and_differ_between_maps():
    torch.manual_seed(123)
    a, b = FavorFeatureMap(8), FavorFeatureMap(8)
    torch.manual_seed(123)
    assert FavorFeatureMap(8).seed == a.seed and a.seed != b.seed


def test_favor_redraw_schedule_survives_state_dict_round_trip(tmp_path):
    block = LinearAttention(16, 2, feature_map_options={"num_features": 8, "redraw_interval": 2})
    x = torch.randn(1, 5, 16)
    for _ in range(3):
        block(x)
    path = tmp_path / "block.pt"
    torch.save(block.state_dict(), path)
    restored = LinearAttention(16, 2, feature_map_options={"num_features": 8, "redraw_interval": 2})
    restored.load_state_dict(torch.load(path, weights_only=True))
    for a, b in ((block, restored), (block, restored)):
        a(x), b(x)
        assert torch.equal(a.feature_map.projection, b.feature_map.projection)
    assert restored.feature_map.get_extra_state() == block.feature_map.get_extra_state()


@pytest.mark.parametrize("state", [{"bogus": 1}, {"seed": 0, "draws": -1, "training_calls": 2},
                                   {"seed": 0, "draws": 1, "training_calls": 2.5}, [0, 1, 2]])
def test_a_damaged_redraw_state_is_refused_by_name(state):
    block = LinearAttention(16, 2, feature_map_options={"num_features": 8})
    saved = block.state_dict()
    saved["feature_map._extra_state"] = state
    with pytest.raises(ValueError, match=r"redraw state should be integers in \[0, 2\*\*63\)"):
        block.load_state_dict(saved)


@pytest.mark.parametrize("name", ["elu", "favor", "softmax"])
@pytest.mark.parametrize("rope", ["post", "pre", "none"])
@pytest.mark.parametrize("autocast", [False, True])
def test_no_inf_or_nan_for_inputs_up_to_100(name, rope, autocast):
    block = LinearAttention(64, 4, feature_map=name, rope=rope)
    x = torch.empty(2, 70, 64).uniform_(-100, 100)
    x[0, :, :] = torch.randn(70, 64) * 100
    x[1, :35] = 100.0                                    # saturated tokens
    x.requires_grad_(True)
    with torch.nn.utils.parametrize.cached(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        # q, k, v entries reach |x| = 100 and beyond: the projections are the identity here
        with torch.no_grad():
            block.to_qkv.weight.copy_(torch.cat([torch.eye(64)] * 3))
        y = block(x)
    y.float().sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()


def test_favor_log_features_are_the_log_of_the_unstabilised_features():
    fm = FavorFeatureMap(8, num_features=16, seed=3).double()
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    scaled = x * 8 ** -0.25
    exact = scaled @ fm.projection.T - scaled.square().sum(-1, keepdim=True) / 2 - 0.5 * torch.log(torch.tensor(16.0))
    for is_query in (True, False):
        log_phi = fm.log_features(x, is_query=is_query)
        torch.testing.assert_close(log_phi, exact.to(log_phi.dtype))
        # forward() is the same up to a per-row constant (its stabilisers)
        ratio = fm(x, is_query=is_query).log() - log_phi
        torch.testing.assert_close(ratio, ratio[..., :1].expand_as(ratio))


def test_softmax_log_features_are_log_softmax_and_the_key_logits():
    fm = make_feature_map("softmax", 8)
    x = torch.randn(1, 1, 5, 8) * 200          # keys far beyond exp's float32 range
    torch.testing.assert_close(fm.log_features(x, is_query=True), x.log_softmax(-1))
    assert torch.equal(fm.log_features(x, is_query=False), x)


def test_only_maps_that_say_so_give_log_features():
    assert FavorFeatureMap.log_space and make_feature_map("softmax", 4).log_space
    elu = make_feature_map("elu", 4)
    assert not elu.log_space
    with pytest.raises(NotImplementedError, match="log_features"):
        elu.log_features(torch.randn(1, 1, 2, 4), is_query=True)


@pytest.mark.parametrize("name", ["favor", "softmax"])
@pytest.mark.parametrize("rope", ["post", "pre", "none"])
def test_block_in_log_space_matches_plain_features_at_ordinary_scale(name, rope, monkeypatch):
    torch.manual_seed(0)
    block = LinearAttention(32, 2, feature_map=name, rope=rope, chunk_size=8).double()
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    log_space = block(x)
    monkeypatch.setattr(type(block.feature_map), "log_space", False)
    torch.testing.assert_close(log_space, block(x), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("scale", [30, 100])
@pytest.mark.parametrize("rope", ["post", "pre", "none"])
def test_favor_block_has_no_zero_rows_at_large_input_scale(scale, rope):
    """Plain FAVOR+ features (keys shifted by a constant of the projection) returned exactly zero
    for 87% of rows at |x| = 30 and for all of them at |x| = 100; the log-space path for none."""
    torch.manual_seed(0)
    block = LinearAttention(64, 4, rope=rope)
    x = (torch.randn(2, 50, 64) * scale).requires_grad_(True)
    y = block(x)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert not (y == 0).all(-1).any()


# ----------------------------------------------------------------------------- hedgehog and taylor

def test_hedgehog_weights_exist_at_construction_and_start_at_the_identity():
    fm = make_feature_map("hedgehog", 8, heads=3)
    assert fm.num_features == 16 and [name for name, _ in fm.named_parameters()] == ["weight"]
    torch.testing.assert_close(fm.weight.detach(), torch.eye(8).expand(3, 8, 8))
    wide = make_feature_map("hedgehog", 8, heads=2, options={"num_features": 32})   # 8 -> 16: semi-orthogonal
    for head in wide.weight.detach():
        torch.testing.assert_close(head @ head.T, torch.eye(8), atol=1e-5, rtol=0)


@pytest.mark.parametrize("activation", ["softmax", "exp"])
def test_hedgehog_features_over_z_and_minus_z(activation):
    fm = make_feature_map("hedgehog", 8, heads=2, options={"num_features": 12, "activation": activation}).double()
    x = torch.randn(3, 2, 5, 8, dtype=torch.float64)
    z = torch.einsum("bhnd,hdf->bhnf", x, fm.weight)
    logits = torch.cat((z, -z), dim=-1)
    expected = logits.softmax(-1) if activation == "softmax" else logits.exp()
    for is_query in (True, False):
        torch.testing.assert_close(fm(x, is_query=is_query), expected)
        torch.testing.assert_close(fm.log_features(x, is_query=is_query).exp(), expected)
    assert fm.log_space and fm.nonnegative_features


def test_hedgehog_and_taylor_draws_follow_torch_manual_seed():
    def draw(seed):
        torch.manual_seed(seed)
        return [make_feature_map(name, 8, heads=2, options=options).weight.detach()
                for name, options in (("hedgehog", {"num_features": 32}), ("taylor", {"dim": 4}))]
    for a, b in zip(draw(0), draw(0)):
        assert torch.equal(a, b)
    for a, b in zip(draw(0), draw(1)):
        assert not torch.equal(a, b)


@pytest.mark.parametrize("name, options, message", [
    ("hedgehog", {"num_features": 7}, "num_features must be an even integer >= 2"),
    ("hedgehog", {"num_features": 0}, "num_features must be an even integer >= 2"),
    ("hedgehog", {"num_features": 8.0}, "num_features must be an even integer >= 2"),
    ("hedgehog", {"activation": "relu"}, "activation must be one of.*got 'relu'"),
    ("taylor", {"dim": 0}, "dim must be a positive integer"),
    ("taylor", {"dim": "16"}, "dim must be a positive integer"),
    ("taylor", {"num_features": 16}, r"\['num_features'\]; it accepts: \['dim'\]"),
])
def test_trainable_map_options_are_validated(name, options, message):
    with pytest.raises(ValueError, match=message):
        make_feature_map(name, 8, heads=2, options=options)


@pytest.mark.parametrize("heads", [0, -1, 2.0, True])
def test_heads_must_be_a_positive_integer(heads):
    assert feature_map_options(FEATURE_MAPS["hedgehog"]) == ["num_features", "activation"]   # heads: no option
    with pytest.raises(ValueError, match="heads must be a positive integer"):
        make_feature_map("hedgehog", 8, heads=heads)


@pytest.mark.parametrize("dim, num_features, padding", [(16, 154, 1), (4, 16, 1), (2, 6, 0), (1, 4, 1)])
def test_taylor_size_is_one_plus_d_plus_the_upper_triangle_padded_to_even(dim, num_features, padding):
    fm = make_feature_map("taylor", 32, heads=1, options={"dim": dim})
    assert fm.num_features == num_features and fm.padding == padding
    features = fm(torch.randn(1, 1, 3, 32), is_query=True)
    assert features.shape == (1, 1, 3, num_features) and torch.equal(features[..., 0], torch.ones(1, 1, 3))
    if padding:
        assert torch.equal(features[..., -1], torch.zeros(1, 1, 3))


@pytest.mark.parametrize("scale", [0.1, 1.0, 30.0])
def test_taylor_kernel_is_the_second_order_taylor_polynomial_of_exp(scale):
    fm = make_feature_map("taylor", 8, heads=2, options={"dim": 5}).double()
    q, k = (torch.randn(2, 2, 7, 8, dtype=torch.float64) * scale for _ in range(2))
    kernel = fm(q, is_query=True) @ fm(k, is_query=False).transpose(-1, -2)
    s = fm.project(q) @ fm.project(k).transpose(-1, -2) / 5 ** 0.5
    torch.testing.assert_close(kernel, 1 + s + s ** 2 / 2)
    assert kernel.min() >= 0.5 - 1e-12   # (1 + s)^2 / 2 + 1/2
    assert fm(q, is_query=True).min() < 0 and not fm.nonnegative_features and not fm.log_space


@pytest.mark.parametrize("causal", [True, False])
def test_taylor_denominator_is_positive_and_only_an_opt_in_lets_negative_features_through(causal):
    fm = make_feature_map("taylor", 8, heads=2, options={"dim": 4})
    q, k, v = torch.randn(2, 2, 40, 8) * 5, torch.randn(2, 2, 40, 8) * 5, torch.randn(2, 2, 40, 8)
    phi_q, phi_k = fm(q, is_query=True), fm(k, is_query=False)
    kernel = phi_q @ phi_k.transpose(-1, -2)
    assert (kernel.tril() if causal else kernel).sum(-1).min() > 0   # the denominators
    assert linear_attention(phi_q, phi_k, v, causal=causal, rotary=False).isnan().any()   # (an error in debug mode)
    out = linear_attention(phi_q, phi_k, v, causal=causal, rotary=True, nonnegative_features=False)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="log_space=True takes log-features"):
        linear_attention(phi_q, phi_k, v, causal=causal, rotary=False, log_space=True, nonnegative_features=False)


def test_the_base_class_declares_nonnegative_features():
    assert FeatureMap.nonnegative_features and all(
        cls.nonnegative_features for name, cls in FEATURE_MAPS.items() if name != "taylor")


def test_a_map_class_and_its_options_are_found_by_name():
    assert linattn.feature_map_class("favor") is FavorFeatureMap
    assert linattn.feature_map_options("favor") == ["num_features", "redraw_interval", "seed"]
    assert linattn.feature_map_options("favor") == linattn.feature_map_options(FavorFeatureMap)
    assert linattn.feature_map_options("hedgehog") == ["num_features", "activation"]   # heads: structural
    for unknown in ("nope", None, ["favor"]):
        with pytest.raises(ValueError, match="registered feature maps: elu, favor"):
            linattn.feature_map_class(unknown)
    with pytest.raises(ValueError, match="unknown feature map 'nope'"):
        linattn.feature_map_options("nope")


@pytest.mark.parametrize("option", ["heads", "head_dim"])
def test_options_the_block_sets_are_refused_as_options(option: str) -> None:
    with pytest.raises(ValueError, match=f"set by the attention block.*drop them"):
        LinearAttention(16, 2, feature_map="taylor", feature_map_options={option: 3})


@pytest.mark.parametrize("option", ["heads", "head_dim"])
def test_make_feature_map_takes_options_as_a_dict_beside_the_structural_heads(option: str) -> None:
    """An option named like a structural parameter cannot collide with heads=: it is refused."""
    assert make_feature_map("hedgehog", 8, heads=2, options={"num_features": 6}).num_features == 6
    with pytest.raises(ValueError, match=rf"\['{option}'\] are set by the attention block"):
        make_feature_map("taylor", 8, heads=2, options={option: 3})
    with pytest.raises(ValueError, match="feature-map options must be a dict"):
        make_feature_map("favor", 8, options=[("num_features", 8)])


def test_option_names_are_checked_once_per_map_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """make_feature_map validates the options; LinearAttention passes them on unchecked."""
    calls = []
    check = linattn.feature_maps.check_option_names
    counted = lambda *args: calls.append(args) or check(*args)
    for module in (linattn, linattn.feature_maps, linattn.attention):
        monkeypatch.setattr(module, "check_option_names", counted, raising=False)
    LinearAttention(16, 2, feature_map="taylor", feature_map_options={"dim": 4})
    assert len(calls) == 1


SIZE_OPTIONS = {"favor": {"num_features": 24}, "hedgehog": {"num_features": 10}, "taylor": {"dim": 5}}


@pytest.mark.parametrize("name", LIBRARY_MAPS)
def test_a_maps_class_knows_its_num_features_before_it_is_built(name: str) -> None:
    assert set(LIBRARY_MAPS) >= {"elu", "favor", "hedgehog", "softmax", "taylor"}
    cls = linattn.feature_map_class(name)
    for options in ({}, SIZE_OPTIONS.get(name, {})):
        built = make_feature_map(name, 16, heads=2, options=options)
        assert cls.num_features_for(16, options) == built.num_features, options
    assert linattn.TaylorFeatureMap.num_features_for(64, {}) == 154
    assert linattn.TaylorFeatureMap.num_features_for(64, {"dim": 4}) == 16
    assert linattn.HedgehogFeatureMap.num_features_for(64, {}) == 128


def test_map_methods_run_unwrapped_and_a_given_map_is_checked_once_where_it_enters():
    """Maps are checked when a block takes them (check_feature_map), not on every call."""
    for cls in FEATURE_MAPS.values():
        assert not hasattr(cls.forward, "__wrapped__")

    class Doubled(FeatureMap):
        def forward(self, x, *, is_query):
            return torch.cat([x.relu(), (-x).relu()], -1)   # 2D features; num_features left at D

    with pytest.raises(ValueError, match="num_features"):
        LinearAttention(16, 2, feature_map=Doubled(8), rope="post")
    with pytest.raises(ValueError, match="num_features"):
        linattn.check_feature_map(Doubled(8))


@pytest.mark.parametrize("name", ["favor", "softmax", "hedgehog"])
def test_check_feature_map_checks_every_method_of_a_log_space_map(name, monkeypatch):
    fm = make_feature_map(name, 8, heads=2)
    assert linattn.check_feature_map(fm, 8, heads=2) is fm
    real = type(fm).log_features
    monkeypatch.setattr(type(fm), "log_features", lambda self, x, *, is_query: real(self, x, is_query=is_query)[..., :3])
    with pytest.raises(ValueError, match="gave 3 features"):
        linattn.check_feature_map(fm)


class Probed(FeatureMap):
    """A map whose forward (and log_features, when log_space) is given per test."""
    def __init__(self, head_dim, forward, logs=None, nonnegative=True):
        super().__init__(head_dim)
        self.compute, self.logs, self.log_space, self.nonnegative_features = forward, logs, logs is not None, nonnegative

    def forward(self, x, *, is_query):
        return self.compute(x)

    def log_features(self, x, *, is_query):
        return self.logs(x)


@pytest.mark.parametrize("forward, logs, nonnegative, word", [
    (lambda x: x, None, True, "negative features"),
    (lambda x: x * torch.nan, None, True, "NaN"),
    (torch.zeros_like, None, True, "all zeros"),
    (lambda x: x.long(), None, True, "floating-point"),
    (lambda x: x[..., :1, :], None, True, "shape"),
    (lambda x: 1 / 0, None, True, "ZeroDivisionError"),
    (lambda x: x, None, False, "phi(q).phi(k) is negative"),
    (torch.exp, lambda x: 2 * x, True, "per-row constant"),
])
def test_check_feature_map_refuses_what_linear_attention_cannot_divide_by(forward, logs, nonnegative, word):
    with pytest.raises(ValueError, match=re.escape(word)):
        LinearAttention(16, 2, feature_map=Probed(8, forward, logs, nonnegative), rope="post")


@pytest.mark.parametrize("forward, logs, nonnegative", [
    (torch.exp, lambda x: x + x.sum(-1, keepdim=True), True),   # log(forward) up to a per-row constant
    (torch.relu, lambda x: x.relu().log(), True),   # features of exactly 0: log-features of -inf
    (lambda x: torch.cat([torch.ones_like(x[..., :1]), x, (x[..., :, None] * x[..., None, :]).flatten(-2) / 2 ** 0.5],
                         -1), None, False),   # 1 + q.k + (q.k)^2 / 2 >= 1/2: Taylor's kernel
])
def test_check_feature_map_passes_maps_that_keep_the_contract(forward, logs, nonnegative):
    fm = Probed(8, forward, logs, nonnegative)
    fm.num_features = forward(torch.zeros(1, 8)).shape[-1]
    assert linattn.check_feature_map(fm) is fm


@pytest.mark.parametrize("pointwise, word", [("elu", "is not its pointwise formula"), ("relu", "pointwise = 'relu'")])
def test_check_feature_map_refuses_a_pointwise_name_its_forward_does_not_keep(pointwise, word):
    """The fla route computes a pointwise map's features from the formula's name, not from its forward:
    a forward that computes something else (a subclass that kept the name), or a name without a formula."""
    fm = Probed(8, torch.relu)
    fm.pointwise = pointwise
    with pytest.raises(ValueError, match=re.escape(word)):
        linattn.check_feature_map(fm)


def test_check_feature_map_refuses_a_map_made_for_another_block():
    fm = make_feature_map("taylor", 8, heads=2, options={"dim": 4})
    with pytest.raises(ValueError, match="heads"):
        linattn.check_feature_map(fm, 8, heads=3)
    with pytest.raises(ValueError, match="head_dim"):
        linattn.check_feature_map(fm, 16)
    with pytest.raises(ValueError, match="FeatureMap"):
        linattn.check_feature_map(torch.nn.Identity(), 8)


def test_check_feature_map_draws_nothing_and_moves_no_redraw_schedule():
    fm = make_feature_map("favor", 8, options={"redraw_interval": 1}).train()
    projection, state = fm.projection.clone(), torch.random.get_rng_state()
    linattn.check_feature_map(fm, 8)
    assert torch.equal(torch.random.get_rng_state(), state) and fm.training
    assert fm.training_calls == 0 and torch.equal(fm.projection, projection)


def test_the_registry_helpers_refuse_what_they_cannot_answer():
    with pytest.raises(ValueError, match="a FeatureMap subclass, got 3"):
        feature_map_options(3)
    with pytest.raises(ValueError, match="a FeatureMap subclass, got EluFeatureMap"):
        feature_map_options(make_feature_map("elu", 4))
    with pytest.raises(ValueError, match="options must be a dict.*got NoneType"):
        linattn.check_option_names("favor", None)
    with pytest.raises(ValueError, match=r"unknown feature map 'nope'"):
        linattn.check_option_names("nope", {"seed": 1})
    with pytest.raises(ValueError, match=r"heads must be a positive integer, got 'x'"):
        make_feature_map("elu", 4, heads="x")
    elu = type(make_feature_map("elu", 4))
    with pytest.raises(ValueError, match=r"as an instance \(EluFeatureMap\(head_dim"):
        LinearAttention(8, 2, feature_map=elu)
