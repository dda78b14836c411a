"""The byte-level LM: configuration checks, recurrent decoding == parallel forward, sampling,
position limits, feature-map layer seeds.  Linear variants cover every registered feature map."""
from __future__ import annotations

from dataclasses import asdict

import linattn
import pytest
import torch

from linattn_lm import ByteLM, ModelConfig, layer_seed
from linattn_lm.checkpoint import saved_section
from tests.conftest import LIBRARY_MAPS

VARIANTS = {
    **{f"linear-{name}-{rope}": dict(feature_map=name, rope=rope)
       for name in linattn.available_feature_maps() for rope in linattn.ROPE_PLACEMENTS},
    "linear-elu-post-abs": dict(feature_map="elu", rope="post", abs_pos=True),
    **{f"linear-{name}-{rope}-rmsnorm": dict(feature_map=name, rope=rope, normalization="rmsnorm")
       for name in ("favor", "hedgehog", "taylor") for rope in ("post", "none")},
    "softmax-rope": dict(attention="softmax", rope="post"),
    "softmax-abs": dict(attention="softmax", rope="none", abs_pos=True),
}
FAVOR = {"num_features": 16, "redraw_interval": 1000}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)   # tiny models: one thread is faster and robust on a shared CPU


@pytest.fixture
def make_model(small_config):
    def make(seq_len: int = 32, **overrides) -> ByteLM:
        if overrides.get("feature_map", "favor") == "favor" and overrides.get("attention") != "softmax":
            overrides.setdefault("feature_map_options", FAVOR)
        torch.manual_seed(0)
        return ByteLM(small_config(seq_len=seq_len, **overrides)).eval()
    return make


@pytest.mark.parametrize("name", VARIANTS)
def test_prefill_and_steps_match_full_forward(name: str, make_model) -> None:
    model = make_model(**VARIANTS[name])
    idx = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        full = model(idx)
        logits, state = model.prefill(idx[:, :9])
        stepped = [logits]
        for position in range(9, 24):
            step_logits, state = model.step(idx[:, position], state)
            stepped.append(step_logits[:, None])
    torch.testing.assert_close(torch.cat(stepped, dim=1), full, atol=2e-5, rtol=1e-4)
    assert state.position == 24


@pytest.mark.parametrize("name", ["linear-favor-post", "softmax-rope"])
def test_generate_is_reproducible_and_greedy_matches_argmax(name: str, make_model) -> None:
    model = make_model(**VARIANTS[name])
    prompt = torch.tensor([72, 101, 108, 108, 111])
    draw = lambda seed: model.generate(prompt, 20, temperature=1.0, top_k=50,
                                       generator=torch.Generator().manual_seed(seed))
    assert torch.equal(draw(3), draw(3))
    assert not torch.equal(draw(3), draw(4))
    greedy = model.generate(prompt, 6, temperature=0)
    ids = prompt.clone()
    for _ in range(6):   # greedy decoding by full forward passes
        ids = torch.cat((ids, model(ids[None])[0, -1].argmax()[None]))
    assert torch.equal(greedy, ids[len(prompt):])


def test_top_k_one_is_greedy(make_model) -> None:
    model = make_model()
    prompt = torch.tensor([1, 2, 3])
    sampled = model.generate(prompt, 8, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled, model.generate(prompt, 8, temperature=0))


def test_generate_keeps_training_mode_and_favor_schedule(make_model) -> None:
    model = make_model().train()
    calls = [fm.training_calls for fm in model.feature_maps()]
    model.generate(torch.tensor([1, 2]), 5)
    assert model.training and [fm.training_calls for fm in model.feature_maps()] == calls


def test_learned_positions_refuse_beyond_training_length(make_model) -> None:
    model = make_model(seq_len=16, **VARIANTS["softmax-abs"])
    model(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="absolute positions for 16 tokens"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="absolute positions"):
        model.generate(torch.zeros(10, dtype=torch.long), 8)
    assert model.generate(torch.zeros(10, dtype=torch.long), 7).shape == (7,)


@pytest.mark.parametrize("name", ["linear-favor-post", "softmax-rope", "linear-favor-none"])
def test_rope_and_no_positions_extrapolate(name: str, make_model) -> None:
    model = make_model(seq_len=16, **VARIANTS[name])
    assert model(torch.zeros(1, 64, dtype=torch.long)).shape == (1, 64, 256)
    assert model.generate(torch.zeros(10, dtype=torch.long), 40).shape == (40,)


def test_favor_layer_seeds_differ_per_layer_and_reproduce(make_model) -> None:
    projections = lambda model: [fm.projection.clone() for fm in model.feature_maps()]
    first, again = projections(make_model(seed=5)), projections(make_model(seed=5))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first[0], projections(make_model(seed=6))[0])
    seeds = [fm.seed for fm in make_model(seed=5).feature_maps()]
    assert seeds == [layer_seed(5, 0), layer_seed(5, 1)]


@pytest.mark.parametrize("overrides, message", [
    (dict(attention="softmax", rope="pre", feature_map="", feature_map_options={}), "'pre'"),
    (dict(attention="softmax", feature_map="favor"), "no feature map"),
    (dict(feature_map="elu", feature_map_options={"num_features": 64}), "does not take option"),
    (dict(feature_map="favor", feature_map_options={"num_features": 0}), "num_features must be a positive integer"),
    (dict(feature_map="favor", feature_map_options={"num_features": 33}), "num_features must be even"),
    (dict(feature_map="favor", feature_map_options={"num_features": [1]}), "not a plain value"),
    (dict(feature_map="nope"), "unknown feature map"),
    (dict(d_model=30, n_head=4), "multiple"),
    (dict(n_layer=0), "n_layer must be positive"),
    (dict(vocab_size=0), "vocab_size must be positive"),
    (dict(n_layer="2"), "n_layer must be int"),
    (dict(dropout=1.0), "dropout"),
    (dict(mlp_ratio=float("nan")), "mlp_ratio must be a finite number"),
    (dict(mlp_ratio=0.001), "gives an MLP 0 wide"),
    (dict(seed=2**64), "seed must be in"),
    (dict(attention="rnn"), "attention must be one of"),
    (dict(feature_map_options={"num_features": 10**9}), "would need about"),
    (dict(backend="cuda"), "linear attention's backend must be one of"),
    (dict(normalization="layernorm"), r"one of \('denominator', 'rmsnorm'\)"),
    (dict(attention="softmax", feature_map="", feature_map_options={}, normalization="rmsnorm"),
     "'rmsnorm' applies to linear attention only"),
    (dict(feature_map="hedgehog", feature_map_options={"num_features": 9}), "num_features must be an even integer"),
    (dict(feature_map="taylor", feature_map_options={"dim": -2}), "dim must be a positive integer"),
    (dict(attention="softmax", feature_map="", feature_map_options={}, backend="triton"),
     "softmax attention's backend must be one of"),
])
def test_config_errors(overrides: dict, message: str) -> None:
    config = ModelConfig(**{"feature_map_options": {"num_features": 16}, **overrides})
    with pytest.raises(ValueError, match=message):
        config.validate()


def test_building_a_layers_map_checks_its_option_names_once(monkeypatch) -> None:
    """make_feature_map is the one place that validates options; the harness passes them as a dict."""
    calls = []
    check = linattn.feature_maps.check_option_names
    counted = lambda *args: calls.append(args) or check(*args)
    for module in (linattn, linattn.feature_maps):
        monkeypatch.setattr(module, "check_option_names", counted)
    ModelConfig(n_head=2, d_model=16, feature_map="taylor", feature_map_options={"dim": 4}).build_feature_map(0)
    assert len(calls) == 1
    with pytest.raises(ValueError, match=r"\['heads'\] are set by the attention block"):
        ModelConfig(feature_map="taylor", feature_map_options={"heads": 2}).validate()


@pytest.mark.parametrize("name", LIBRARY_MAPS)
@pytest.mark.parametrize("options", [{}, {"num_features": 24}, {"dim": 5}])
def test_the_memory_estimate_takes_m_from_the_map(name: str, options: dict) -> None:
    """taylor's M is 1 + d' + d'(d'+1)/2 padded to even (154 at d' = 16), hedgehog's 2 head_dim:
    the estimate asks the map's class, so it matches the map that gets built."""
    options = {key: value for key, value in options.items() if key in linattn.feature_map_options(name)}
    config = ModelConfig(d_model=64, n_head=2, feature_map=name, feature_map_options=options)
    assert config.num_features == config.build_feature_map(0).num_features
    if name == "taylor" and not options:
        assert config.num_features == 154


def test_variant_names(small_config) -> None:
    assert small_config(feature_map_options={"num_features": 256}).variant == "linear-favor-post-M256"
    assert small_config(feature_map="elu", rope="pre", abs_pos=True).variant == "linear-elu-pre-abs"
    assert small_config(attention="softmax").variant == "softmax-rope"
    assert small_config(attention="softmax", rope="none", abs_pos=True).variant == "softmax-abs"
    assert small_config(attention="softmax", rope="none").variant == "softmax-none"
    assert small_config(normalization="rmsnorm").variant == "linear-favor-post-rmsnorm-M16"
    assert small_config(feature_map="taylor", rope="pre", normalization="rmsnorm").variant == "linear-taylor-pre-rmsnorm"


@pytest.mark.parametrize("feature_map, options", [("hedgehog", {"num_features": 64}), ("taylor", {"dim": 4})])
def test_maps_with_weights_are_parameters_reproducible_from_the_seed(feature_map, options, small_config) -> None:
    config = small_config(feature_map=feature_map, feature_map_options=options)
    def build(seed: int) -> dict:
        torch.manual_seed(seed)
        return ByteLM(config).state_dict()
    a, b, c = build(0), build(0), build(1)
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert not torch.equal(a["blocks.0.attn.feature_map.weight"], c["blocks.0.attn.feature_map.weight"])
    names = [name for name, _ in ByteLM(config).named_parameters()]
    assert "blocks.1.attn.feature_map.weight" in names   # the optimiser sees them


def test_config_round_trips_through_a_plain_dict(small_config) -> None:
    config = small_config(abs_pos=True)
    values = asdict(config)
    assert all(isinstance(v, (str, int, float, bool, dict)) for v in values.values())
    assert saved_section({"model": values}, "model") == config
    with pytest.raises(ValueError, match=r"unknown model setting\(s\) \['lr'\]"):
        saved_section({"model": {**values, "lr": 0.1}}, "model")


@pytest.mark.parametrize("attention, backend, expected", [
    ("linear", "fla", "fla"), ("linear", "auto", "auto"), ("softmax", "auto", "sdpa"),
    ("softmax", "xformers", "xformers"),
])
def test_backend_reaches_every_attention_block(attention, backend, expected, monkeypatch) -> None:
    monkeypatch.setattr(linattn.attention, "_xformers_ops", lambda: None)   # xformers is CUDA-only
    linear = attention == "linear"
    config = ModelConfig(attention=attention, backend=backend, feature_map="favor" if linear else "",
                         feature_map_options={"num_features": 16} if linear else {}, n_layer=2)
    config.validate()
    assert [block.attn.backend for block in ByteLM(config).blocks] == [expected] * 2
