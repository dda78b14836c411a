"""The gap-closers' harness side: --window, --decay and --softmax-layers in the config, in variant
names (built and parsed by one codec) and in the blocks the model builds; a hybrid's softmax layers
end to end."""
from __future__ import annotations

from pathlib import Path

import linattn
import pytest
import torch

from linattn_lm import ByteLM, config_from_flags, evaluate, training
from linattn_lm.resume import config_differences
from linattn_lm.variants import BLOCK_OPTIONS
from linattn_lm.grid_report import comparable_pairs, softmax_baseline, val_bpc, window_control_table
from linattn_lm.lm import state_size
from linattn_lm.variants import variant_flags

FAVOR = {"num_features": 16, "redraw_interval": 1000}


def assert_decodes_as_parallel(model: ByteLM, tokens: int = 20, prefill: int = 7):
    """A prefill of `prefill` tokens, then steps, give the parallel pass's logits; returns the tokens,
    the parallel pass's logits and the last state."""
    idx = torch.randint(0, 256, (2, tokens))
    with torch.no_grad():
        full = model(idx)
        logits, state = model.prefill(idx[:, :prefill])
        stepped = [logits]
        for position in range(prefill, tokens):
            step_logits, state = model.step(idx[:, position], state)
            stepped.append(step_logits[:, None])
    torch.testing.assert_close(torch.cat(stepped, dim=1), full, atol=2e-5, rtol=1e-4)
    return idx, full, state


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture
def block_kwargs(monkeypatch):
    """The keywords each LinearAttention is built with; the block is built without window and decay
    (the library may not take them yet), so only what the harness passes is under test."""
    calls: list[dict] = []
    real = linattn.LinearAttention

    def record(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **{key: value for key, value in kwargs.items() if key not in ("window", "decay")})
    monkeypatch.setattr(linattn, "LinearAttention", record)
    return calls


@pytest.mark.parametrize("name, block", [
    ("linear-favor-pre+window=64", {"window": 64}),
    ("linear-favor-post+decay=retnet", {"decay": "retnet"}),
    ("linear-favor-pre+softmax_layers=1", {"softmax_layers": "1"}),
    ("linear-taylor-pre+window=8+decay=0.5_0.9_0.99_1.0", {"window": 8, "decay": "0.5,0.9,0.99,1.0"}),
    ("linear-favor-none+softmax_layers=1_3+redraw_interval=0", {"softmax_layers": "1,3"}),
    ("linear-favor-post+window=8+short_conv=3", {"window": 8, "short_conv": 3}),
])


def test_block_options_in_variant_names_round_trip(name: str, block: dict) -> None:
    flags = variant_flags(name)
    assert {key: flags[key] for key in BLOCK_OPTIONS if key in flags} == block
    assert "window" not in flags["feature_map_options"] and "decay" not in flags["feature_map_options"]
    config = config_from_flags({**flags, "preset": "cpu"})
    built = config.model.variant
    assert config.run.run_name == built
    suffix = [part for part in built.split("+")[1:] if part.split("=")[0] in BLOCK_OPTIONS]
    assert suffix == [part for part in name.split("+")[1:] if part.split("=")[0] in BLOCK_OPTIONS]
    reparsed = variant_flags(f"linear-favor-pre+{'+'.join(suffix)}")
    assert {key: reparsed[key] for key in block} == block


def test_defaults_keep_todays_names_and_flags() -> None:
    assert variant_flags("linear-favor-post+redraw_interval=500") == dict(
        attention="linear", feature_map="favor", rope="post", abs_pos=False, normalization="denominator",
        feature_map_options={"redraw_interval": 500})
    assert config_from_flags({"preset": "cpu"}).model.variant == "linear-favor-post-M64"
    assert config_from_flags({"preset": "cpu", "attention": "softmax"}).model.variant == "softmax-rope"


def test_a_config_from_before_the_options_resumes_unchanged() -> None:
    flat = config_from_flags({"preset": "tiny"}).flat()
    older = {key: value for key, value in flat.items() if key not in BLOCK_OPTIONS}
    assert config_differences(older, flat) == []
    changed = config_from_flags({"preset": "tiny", "window": 8}).flat()
    assert config_differences(older, changed) == ["window: checkpoint 0, now 8"]


@pytest.mark.parametrize("name, message", [
    ("linear-favor-pre+window=x", "whole number"),
    ("linear-favor-pre+window=0", "default"),
    ("linear-favor-pre+decay=", "default"),
    ("linear-favor-pre+window=8+window=16", "twice"),
    ("softmax-rope+redraw_interval=0", "unknown variant"),
    ("softmax-rope+window=0", "default"),
    ("linear-favor-pre+window=08", "spelled window=8"),      # one spelling per value: the name is a directory
    ("linear-favor-pre+window=1_6", "spelled window=16"),   # int() reads 1_6 as 16
])
def test_bad_block_options_in_names(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        variant_flags(name)


@pytest.mark.parametrize("given, message", [
    ({"window": -1}, "window"),
    ({"decay": "0.9"}, "decay"),                       # the cpu preset has 4 heads
    ({"decay": "0.5,0.9,0.99,1.5"}, "decay"),
    ({"decay": "0.5,0.9,nan,1"}, "decay"),
    ({"decay": "geometric"}, "decay"),
    ({"decay": "0.5, 0.9,0.99,1"}, "decay"),
    ({"softmax_layers": "4"}, "softmax_layers"),       # 4 layers: 0..3
    ({"softmax_layers": "3,1"}, "softmax_layers"),
    ({"softmax_layers": "1,1"}, "softmax_layers"),
    ({"softmax_layers": "1, 3"}, "softmax_layers"),
    ({"softmax_layers": "0,1,2,3"}, "--attention softmax"),   # no linear layer left: not a linear model
    ({"decay": "1,1,1,1.0"}, "no decay"),                # the default, by another name
    ({"decay": "0.5,0.9,0.99,1"}, "'0.5,0.9,0.99,1.0'"),  # one spelling per value
    ({"decay": "0.50,0.9,0.99,1.0"}, "'0.5,0.9,0.99,1.0'"),
    ({**variant_flags("linear-favor-pre+decay=1_1_1_1")}, "no decay"),
    ({"attention": "softmax", "decay": "retnet"}, "--decay"),
    ({"attention": "softmax", "softmax_layers": "1"}, "--softmax-layers"),
    ({"attention": "softmax", "window": -1}, "window"),
    ({"short_conv": 257}, "seq_len"),                    # the cpu preset's context is 256
    ({"attention": "softmax", "short_conv": 257}, "seq_len"),
    ({**variant_flags("softmax-rope+window=8+decay=retnet")}, "--decay"),
])
def test_bad_block_settings(given: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_flags({"preset": "cpu", **given})


def test_a_checkpoint_config_with_options_on_softmax_attention_is_refused() -> None:
    config = config_from_flags({"preset": "tiny", "attention": "softmax"}).model
    config.decay = "retnet"
    with pytest.raises(ValueError, match="decay applies to linear attention only"):
        config.validate()


@pytest.mark.parametrize("given, expected", [
    ({}, {}),
    ({"window": 64}, {"window": 64}),
    ({"decay": "retnet"}, {"decay": "retnet"}),
    ({"window": 8, "decay": "0.5,0.9,0.99,1.0"}, {"window": 8, "decay": (0.5, 0.9, 0.99, 1.0)}),
])
def test_options_reach_every_linear_block(given: dict, expected: dict, block_kwargs) -> None:
    config = config_from_flags({"preset": "cpu", **given})
    ByteLM(config.model)
    assert len(block_kwargs) == config.model.n_layer
    for kwargs in block_kwargs:
        assert {key: kwargs[key] for key in ("window", "decay")} == {"window": 0, "decay": None, **expected}
        assert set(kwargs) - {"window", "decay"} == {"feature_map", "rope", "chunk_size", "backend", "normalization",
                                                     "short_conv"}


def test_hybrid_layers_are_softmax_rope_blocks(block_kwargs) -> None:
    config = config_from_flags({"preset": "cpu", "softmax_layers": "1,3", "rope": "pre", "window": 4}).model
    model = ByteLM(config)
    kinds = [type(block.attn).__name__ for block in model.blocks]
    assert kinds == ["LinearAttention", "SoftmaxAttention", "LinearAttention", "SoftmaxAttention"]
    assert all(model.blocks[layer].attn.rope is not None for layer in (1, 3))
    assert [kwargs["rope"] for kwargs in block_kwargs] == ["pre", "pre"]
    assert len(model.feature_maps()) == 2
    # the linear layers keep their own map seeds: layer 2's map is the one a model without the hybrid draws
    plain = ByteLM(config_from_flags({"preset": "cpu", "rope": "pre", "window": 4}).model)
    torch.testing.assert_close(model.blocks[2].attn.feature_map.projection,
                               plain.blocks[2].attn.feature_map.projection)


def test_a_hybrid_decodes_as_its_parallel_pass(small_config) -> None:
    torch.manual_seed(0)
    model = ByteLM(small_config(softmax_layers="1", feature_map_options=FAVOR, seq_len=32)).eval()
    assert_decodes_as_parallel(model)


def test_a_hybrid_trains_saves_and_scores(data_dir: Path, tiny: list[str], tmp_path: Path, run_main) -> None:
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--softmax-layers", "1", "--steps", "4",
            "--eval-interval", "4", "--ckpt-interval", "4", "--sample-interval", "0"]
    code, out, _ = run_main(training.main, argv)
    assert code == 0
    run_dir = tmp_path / "linear-favor-post-M32+softmax_layers=1"
    assert "model: linear-favor-post-M32+softmax_layers=1" in out and (run_dir / "ckpt.pt").is_file()
    code, out, _ = run_main(evaluate.main, [str(run_dir), "--max-bytes", "2000", "--threads", "1"])
    assert code == 0 and "linear-favor-post-M32+softmax_layers=1" in out


def test_window_and_decay_variants_are_paired_by_their_factors() -> None:
    names = ["linear-favor-pre", "linear-favor-pre+window=64", "linear-favor-post+window=64",
             "linear-favor-post+decay=retnet", "linear-favor-post"]
    configs = {name: config_from_flags({**variant_flags(name), "preset": "cpu"}).flat() for name in names}
    assert comparable_pairs(configs) == [
        ("linear-favor-pre", "linear-favor-pre+window=64", "window"),
        ("linear-favor-pre", "linear-favor-post", "rope"),
        ("linear-favor-pre+window=64", "linear-favor-post+window=64", "rope"),
        ("linear-favor-post+window=64", "linear-favor-post", "window"),
        ("linear-favor-post+decay=retnet", "linear-favor-post", "decay")]


def test_window_and_decay_train_and_decode_end_to_end(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                      run_main, small_config) -> None:
    torch.manual_seed(0)
    model = ByteLM(small_config(window=4, decay="retnet", rope="pre", feature_map_options=FAVOR, seq_len=32)).eval()
    assert_decodes_as_parallel(model)
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--window", "8", "--decay", "retnet",
            "--steps", "4", "--eval-interval", "4", "--ckpt-interval", "4", "--sample-interval", "0"]
    code, _, err = run_main(training.main, argv)
    assert code == 0, err
    assert (tmp_path / "linear-favor-post-M32+window=8+decay=retnet" / "ckpt.pt").is_file()


def test_the_help_names_the_flags_and_the_layer_numbering(run_main) -> None:
    code, out, _ = run_main(training.main, ["--help"])
    assert code == 0 and "--window N" in out and "--decay" in out and "retnet" in out
    assert "--softmax-layers" in out and "0-based" in out


# The window-only control: softmax attention over the last W keys (issue 36's second part).

@pytest.mark.parametrize("name, flags", [
    ("softmax-rope+window=64", dict(attention="softmax", rope="post", abs_pos=False, window=64)),
    ("softmax-none+window=8", dict(attention="softmax", rope="none", abs_pos=False, window=8)),
    ("softmax-rope-abs+window=1", dict(attention="softmax", rope="post", abs_pos=True, window=1)),
    ("softmax-rope+window=8+short_conv=3", dict(attention="softmax", rope="post", abs_pos=False, window=8,
                                                short_conv=3)),
])
def test_the_window_only_control_round_trips_through_its_name(name: str, flags: dict) -> None:
    assert variant_flags(name) == flags
    config = config_from_flags({**flags, "preset": "cpu"})
    assert config.model.variant == config.run.run_name == name
    block = ByteLM(config.model).blocks[0].attn
    assert block.window == flags["window"]
    assert (block.short_conv.kernel_size if block.short_conv else 0) == flags.get("short_conv", 0)
    assert config_from_flags({"preset": "cpu", "attention": "softmax", **flags}).model.variant == name


def test_softmax_defaults_keep_todays_names_and_blocks() -> None:
    for name in ("softmax-rope", "softmax-abs", "softmax-none", "softmax-rope-abs"):
        config = config_from_flags({**variant_flags(name), "preset": "cpu"}).model
        assert config.variant == name and config.window == config.short_conv == 0
        assert "window" not in variant_flags(name)
    model = ByteLM(config_from_flags({"preset": "tiny", "attention": "softmax"}).model)
    assert all(block.attn.window == 0 for block in model.blocks)


def test_a_checkpoint_config_with_a_decay_on_the_window_control_is_refused() -> None:
    config = config_from_flags({"preset": "tiny", **variant_flags("softmax-rope+window=8")}).model
    config.validate()
    config.softmax_layers = "1"
    with pytest.raises(ValueError, match="softmax_layers applies to linear attention only"):
        config.validate()


def test_the_window_control_pairs_with_softmax_by_its_window() -> None:
    names = ["softmax-rope", "softmax-rope+window=64", "linear-favor-pre+window=64"]
    configs = {name: config_from_flags({**variant_flags(name), "preset": "cpu"}).flat() for name in names}
    assert comparable_pairs(configs) == [("softmax-rope", "softmax-rope+window=64", "window")]
    # softmax + RoPE stays the linear variants' yardstick, whichever order the grid lists them in
    variants = {name: [{"config": configs[name]}] for name in reversed(names)}
    assert softmax_baseline(variants) == "softmax-rope"


def test_windowed_linear_variants_are_paired_with_the_control_of_their_window() -> None:
    names = ["softmax-rope", "softmax-rope+window=64", "linear-favor-pre+window=64", "linear-favor-pre+window=8",
             "linear-favor-pre"]
    configs = {name: config_from_flags({**variant_flags(name), "preset": "cpu"}).flat() for name in names}
    val = {"softmax-rope": 2.4, "softmax-rope+window=64": 2.6, "linear-favor-pre+window=64": 2.5,
           "linear-favor-pre+window=8": 2.7, "linear-favor-pre": 2.8}
    variants = {name: [{"config": configs[name], "seed": seed, "scores": {"val": {"256": val[name] + seed / 100}}}
                       for seed in (0, 1)] for name in names}
    rows = window_control_table(variants, val_bpc(256))[2:]
    assert len(rows) == 1 and rows[0].startswith("| linear-favor-pre+window=64 | softmax-rope+window=64 | linear term |")
    assert "-0.100" in rows[0]


def test_the_window_control_builds_windowed_softmax_blocks_that_decode_as_they_run(small_config) -> None:
    torch.manual_seed(0)
    config = small_config(attention="softmax", feature_map="", feature_map_options={}, window=4, seq_len=32)
    model = ByteLM(config).eval()
    assert [(type(block.attn).__name__, block.attn.window) for block in model.blocks] == \
        [("SoftmaxAttention", 4)] * config.n_layer
    assert state_size(config) == f"4 x 2 x {config.head_dim} KV cache"
    idx, full, state = assert_decodes_as_parallel(model)
    assert all(layer.k.shape[-2] == 4 for layer in state.layers)
    # the window changes the model: a window as long as the context is plain causal softmax
    plain = ByteLM(small_config(attention="softmax", feature_map="", feature_map_options={}, seq_len=32)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain(idx), full)
        model.blocks[0].attn.window = model.blocks[1].attn.window = 32
        torch.testing.assert_close(model(idx), plain(idx))


def test_the_window_control_trains_and_scores_from_the_flags(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                              run_main) -> None:
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--attention", "softmax", "--window", "8",
            "--steps", "4", "--eval-interval", "4", "--ckpt-interval", "4", "--sample-interval", "0"]
    code, out, err = run_main(training.main, argv)
    assert code == 0, err
    run_dir = tmp_path / "softmax-rope+window=8"
    assert "model: softmax-rope+window=8" in out and (run_dir / "ckpt.pt").is_file()
    code, out, _ = run_main(evaluate.main, [str(run_dir), "--max-bytes", "2000", "--threads", "1"])
    assert code == 0 and "softmax-rope+window=8" in out


def test_a_short_convolution_trains_decodes_and_names_its_run(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                             run_main, small_config) -> None:
    torch.manual_seed(0)
    model = ByteLM(small_config(short_conv=3, window=4, feature_map_options=FAVOR, seq_len=32)).eval()
    assert all(block.attn.short_conv.kernel_size == 3 for block in model.blocks)
    assert_decodes_as_parallel(model)
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--short-conv", "3", "--steps", "4",
            "--eval-interval", "4", "--ckpt-interval", "4", "--sample-interval", "0"]
    code, _, err = run_main(training.main, argv)
    assert code == 0, err
    assert (tmp_path / "linear-favor-post-M32+short_conv=3" / "ckpt.pt").is_file()
    code, _, err = run_main(training.main, [*argv, "--short-conv", "-1"])
    assert code == 2 and "short_conv" in err


def test_variant_names_take_the_librarys_block_options_and_the_lms_softmax_layers():
    assert set(BLOCK_OPTIONS) == {*linattn.BLOCK_OPTIONS["linear"], "softmax_layers"}
