"""Model presets (linattn_lm/presets.py and the TOML files of linattn_lm/models/): what they hold, a user's
own file, one-line errors naming the file and the key, and the files shipped with the package."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from linattn_lm import TrainConfig, load_checkpoint, training
from linattn_lm.flags import preset_settings
from linattn_lm.presets import MODELS_DIR, PRESETS

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_presets_list_only_what_differs_from_the_defaults() -> None:
    defaults = TrainConfig().flat()
    assert PRESETS["cpu"] == {}   # the defaults are the cpu preset
    for name, changes in PRESETS.items():
        assert {key: value for key, value in changes.items() if defaults[key] != value} == changes, name
        assert preset_settings(name) == {**defaults, **changes}


@pytest.mark.parametrize("preset", ["cpu", "eleuther", "paper"])
def test_presets_never_redraw_favor(preset: str) -> None:
    """The study measured that redraws cost accuracy (docs/results/study.md): the map's default."""
    assert preset_settings(preset)["feature_map_options"]["redraw_interval"] == 0


def test_each_preset_file_says_in_one_line_what_it_is_for() -> None:
    """A comment line first, then settings only: measurements live in docs/results/presets.md."""
    assert sorted(PRESETS) == sorted(path.stem for path in MODELS_DIR.glob("*.toml"))
    for path in MODELS_DIR.glob("*.toml"):
        lines = path.read_text().splitlines()
        assert lines[0].startswith("# ") and not any("#" in line for line in lines[1:]), path.name


def test_a_users_preset_file_trains(tmp_path: Path, data_dir: Path, run_main, monkeypatch) -> None:
    """train.py --preset my.toml: the file's settings over the defaults, recorded with the file's path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.toml").write_text((MODELS_DIR / "tiny.toml").read_text().replace("d_model = 64", "d_model = 32")
                                      .replace("steps = 30", "steps = 2"))
    code, _, err = run_main(training.main, ["--preset", "my.toml", "--threads", "1", "--data-dir", str(data_dir),
                                            "--run-name", "mine"])
    assert code == 0, err
    config = load_checkpoint(tmp_path / "runs" / "mine")["config"]
    assert (config["model"]["d_model"], config["model"]["n_layer"], config["optim"]["steps"]) == (32, 2, 2)
    assert config["run"]["preset"] == str(tmp_path.resolve() / "my.toml")


@pytest.mark.parametrize("text, key", [
    ("n_layers = 2", "'n_layers' is no setting"),
    ('out_dir = "elsewhere"', "give it as --out-dir"),
    ('preset = "cpu"', "'preset' is a run setting"),
    ('n_layer = "2"', "n_layer must be int"),
    ("lr = true", "lr must be float"),
    ("feature_map_options = { num_features = [32] }", "feature_map_options must be"),
    ("n_layer = ", "not a TOML file"),
])
def test_a_bad_preset_file_is_one_line_naming_the_file_and_the_key(tmp_path: Path, run_main, text: str,
                                                                   key: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f"# a user's preset\n{text}\n")
    code, _, err = run_main(training.main, ["--preset", str(path), "--out-dir", str(tmp_path)])
    assert code == 2 and len(err.strip().splitlines()) == 1 and str(path) in err and key in err, err


def test_a_preset_file_that_is_not_there_is_named(tmp_path: Path, run_main) -> None:
    code, _, err = run_main(training.main, ["--preset", str(tmp_path / "none.toml"), "--out-dir", str(tmp_path)])
    assert code == 2 and "none.toml: cannot read it" in err, err


@pytest.mark.slow
def test_an_installed_package_finds_its_presets(tmp_path: Path) -> None:
    """The wheel holds linattn_lm/models/*.toml, and the package unpacked from it reads them (from a
    directory with no models/ of its own)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source)
    for package in ("linattn", "linattn_lm", "benchmarks"):
        shutil.copytree(REPO_ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "wheel"), str(source)], check=True, cwd=tmp_path)
    installed = tmp_path / "installed"
    zipfile.ZipFile(next((tmp_path / "wheel").glob("*.whl"))).extractall(installed)
    assert sorted(path.name for path in (installed / "linattn_lm" / "models").glob("*.toml")) == \
        sorted(f"{name}.toml" for name in PRESETS)
    read = subprocess.run([sys.executable, "-c", "from linattn_lm.presets import PRESETS; print(sorted(PRESETS))"],
                          cwd=tmp_path, env={"PYTHONPATH": str(installed)}, capture_output=True, text=True)
    assert read.stdout.strip() == str(sorted(PRESETS)), read.stderr
