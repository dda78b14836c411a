"""The benchmark's settings: declared once in `Settings`, presets as data, flags generated from the
fields by the harness's generator (linattn_lm.flags).  Every flag is checked here, so bad input ends in
one line and exit status 2."""
from __future__ import annotations

import argparse
import fnmatch
import math
import os
import tempfile
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

import linattn
from linattn.functional import BACKENDS as LINATTN_BACKENDS
from linattn_lm.device import resolve_device
from linattn_lm.errors import Parser, first_line

import torch

from linattn_lm import PRESETS as TRAINING_PRESETS
from linattn_lm.flags import add_flags, comma_items, flag_name

from .methods import (DTYPES, KERNEL_METHODS, LINEAR_BACKENDS, MASKS, ROPES, SOFTMAX_BLOCKS, Method, Shape,
                      block_names, block_parts, build_attention, build_block, method_table, model_size,
                      unavailable)

SECTIONS = ("attention", "efficiency", "decode", "model", "block", "kernels")
DEFAULT_SECTIONS = SECTIONS[:-1]   # kernels, beside fla's, is for GPUs: --sections kernels or --preset gpu-targets
MODEL_SIZES = ("small",) + tuple(TRAINING_PRESETS)
PASSES = ("fwd", "fwd+bwd")
DEFAULT_LENGTHS = {"cpu": tuple(2 ** p for p in range(8, 16)),      # 256 .. 32768
                   "cuda": tuple(2 ** p for p in range(10, 17))}    # 1024 .. 65536


class BadSetting(ValueError):
    """A setting that cannot work, with what to do instead."""


def _number(text: str, convert: Callable[[str], float], ok: Callable[[float], bool], expected: str):
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ValueError(f"expected {expected}, got {text!r}")
    return value


# Upper bounds of the flags whose size no memory estimate checks: beyond them a run would not end (a
# billion repeats), or fail in every measuring process (100,000 threads).  Lengths and feature counts
# are bounded by the memory they need (check_sizes_fit), and listed lengths by MAX_LENGTH.
MAX_THREADS = os.cpu_count() or 1
MAX_REPEATS = 1000
MAX_STEPS = 10_000
MAX_SIZE = 2 ** 16        # batch, heads, head dimension, chunk
MAX_LENGTH = 2 ** 26      # a context or length in a list, and the model section's tokens per batch
MAX_SECONDS = 86_400.0


def whole(low: int, high: int) -> Callable[[str], int]:
    """A parser of one integer in [low, high]."""
    expected = "a positive integer" if low == 1 else "0 or a positive integer"
    return lambda text: _number(text, int, lambda value: low <= value <= high, f"{expected} up to {high:,}")


positive_int = whole(1, MAX_SIZE)


def seconds(text: str) -> float:
    return _number(text, float, lambda value: math.isfinite(value) and 0 < value <= MAX_SECONDS,
                   f"a positive number of seconds up to {MAX_SECONDS:,.0f}")


def int_list(text: str, high: int | None = MAX_LENGTH) -> tuple[int, ...]:
    """'1024,256,1024' -> (256, 1024): sweeps run small to large, which the budget relies on."""
    try:
        values = tuple(sorted({_number(item, int, lambda value: value >= 1, "") for item in comma_items(text)}))
    except ValueError:
        values = ()
    if not values or (high is not None and values[-1] > high):
        bound = "" if high is None else f" up to {high:,}"
        raise ValueError(f"expected comma-separated positive integers{bound}, got {text!r}")
    return values


def any_length(text: str) -> tuple[int, ...]:
    """--lengths: bounded by the memory the inputs need (check_sizes_fit), which names the sizes."""
    return int_list(text, high=None)


def names(choices: tuple[str, ...] | None = None) -> Callable[[str], tuple[str, ...]]:
    """A parser of comma-separated names, each one of `choices` when given."""
    def parse(text: str) -> tuple[str, ...]:
        given = tuple(dict.fromkeys(comma_items(text)))
        unknown = [item for item in given if choices and item not in choices]
        if not given or unknown:
            among = f" from {','.join(choices)}" if choices else ""
            raise ValueError(f"expected comma-separated names{among}, got {text!r}")
        return given
    return parse


def block_name_list(text: str) -> tuple[str, ...]:
    """Block or LM names, each with its options (methods.block_parts); an unknown one is named with the
    pattern, not the 77 names it could be."""
    given = names()(text)
    known = set(block_names())
    unknown = [item for item in given if item.split("+")[0] not in known]
    if unknown:
        raise ValueError(f"unknown name(s) {','.join(unknown)}: expected {', '.join(SOFTMAX_BLOCKS)} or "
                         f"<map>-<rope>[-<backend>] with map one of {', '.join(linattn.available_feature_maps())}, "
                         f"rope one of {', '.join(ROPES)}, backend one of {', '.join(LINEAR_BACKENDS)}; then "
                         f"+window=W, +short_conv=K and (linear) +decay=retnet if wanted")
    for name in given:
        block_parts(name)   # says what is wrong with an option
    return given


def one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text
    return parse


def option(default, help: str, parse: Callable[[str], object], **flag):
    """A setting and its flag (linattn_lm.flags.add_flags): `flag` holds argparse keywords of its own."""
    return field(default=default, metadata={"help": help, "parse": parse, "flag": flag})


@dataclass(frozen=True)
class Settings:
    sections: tuple[str, ...] = option(DEFAULT_SECTIONS, "sections to run", names(SECTIONS))
    device: str = option("auto", "auto (CUDA when available), cpu or cuda", one_of(("auto", "cpu", "cuda")))
    threads: int = option(0, "torch CPU threads in each measuring process, up to this machine's CPUs; 0 keeps "
                          "torch's default", whole(0, MAX_THREADS))
    methods: tuple[str, ...] = option(("*",), "attention methods, by name or shell pattern "
                                      "(e.g. 'sdpa,favor-*'); the header lists them", names())
    backends: tuple[str, ...] = option(("auto",), "linattn backends to compare; methods other than "
                                       "auto are named <map>-<rope>-<backend>", names(LINATTN_BACKENDS))
    masks: tuple[str, ...] = option(tuple(MASKS), "causal and/or full (non-causal) attention", names(tuple(MASKS)))
    dtypes: tuple[str, ...] = option(("fp32",), "input dtypes", names(tuple(DTYPES)))
    passes: tuple[str, ...] = option(PASSES, "fwd (no_grad forward) and/or fwd+bwd", names(PASSES))
    lengths: tuple[int, ...] = option((), "sequence lengths N [CPU: 256..32768, CUDA: 1024..65536]", any_length)
    batch: int = option(1, "attention batch b", positive_int)
    heads: int = option(8, "attention heads h", positive_int)
    head_dim: int = option(64, "head dimension D", positive_int)
    num_features: int = option(256, "random features M of favor, performer and fla-chunk", whole(1, 2 ** 62))   # check_sizes_fit bounds it
    chunk_size: int = option(64, "chunk C of linattn's torch causal path", positive_int)
    repeats: int = option(5, "timed runs per config and pass (at most 3 for runs over 1 s)", whole(1, MAX_REPEATS))
    warmup: int = option(1, "untimed runs before timing", whole(0, MAX_REPEATS))
    rounds: int = option(1, "block section: run the whole sweep this many times (each config in a fresh process "
                         "each time) and give each config's median over the rounds, so that a slow spell of a "
                         "shared machine hits one round of every config, not every run of one", whole(1, 100))
    budget_s: float = option(90.0, "skip a config predicted to take longer than this many seconds", seconds)
    decode_contexts: tuple[int, ...] = option(tuple(1024 * 2 ** p for p in range(6)),
                                              "context lengths of the decode section", int_list)
    decode_steps: int = option(30, "timed decode steps", whole(1, MAX_STEPS))
    model_contexts: tuple[int, ...] = option((256, 1024, 4096), "LM context lengths of the model section", int_list)
    model_tokens: int = option(4096, "LM tokens per training batch, the same at every context",
                               whole(1, MAX_LENGTH))
    model_steps: int = option(3, "timed LM optimizer steps", whole(1, MAX_STEPS))
    model_methods: tuple[str, ...] = option(("softmax", "favor-post"), "LMs of the model section: softmax "
                                            "(+ RoPE) or <map>-<rope>[-<backend>], with the blocks' options",
                                            block_name_list)
    model_size: str = option("small", "the model section's LM: small (4 x 256, 4 heads) or a training preset's "
                             "layers, width and heads", one_of(MODEL_SIZES))
    block_methods: tuple[str, ...] = option(("softmax", "favor-post", "elu-post"), "blocks of the block section: "
                                            "softmax, softmax-xformers or <map>-<rope>[-<backend>], each optionally "
                                            "+window=W (softmax: the window-only control), +short_conv=K "
                                            "and, linear, +decay=retnet (e.g. favor-pre+window=64)", block_name_list)
    kernel_methods: tuple[str, ...] = option(KERNEL_METHODS, "ops of the kernels section", names(KERNEL_METHODS))
    kernel_features: tuple[int, ...] = option((64, 256), "feature counts M of the kernels section",
                                              lambda text: int_list(text, high=MAX_SIZE))
    keep_freed_memory: bool = option(False, "CPU: each measuring process keeps freed memory in glibc's heap, as "
                                     "train.py does (linattn_lm.device.keep_freed_memory), so that large temporaries "
                                     "stop page-faulting afresh on every pass; default: as imported", bool,
                                     action="store_true")
    out: str = option("bench_results/bench", "output prefix: writes OUT.json, OUT.md and OUT.png", str)
    overwrite: bool = option(False, "replace the results of an earlier run at --out (refused without it)", bool,
                             action="store_true")

    @property
    def shape(self) -> Shape:
        return Shape(self.batch, self.heads, self.head_dim, self.num_features)


PRESETS: dict[str, dict[str, object]] = {
    "full": {},
    "quick": dict(lengths=(256, 1024, 2048), repeats=2, budget_s=10.0, decode_contexts=(1024, 2048),
                  decode_steps=10, model_contexts=(128, 256), model_tokens=256, model_steps=2),
    # Issue 8's CPU table: causal favor+post and favor+none beside torch SDPA, fwd+bwd, 2 threads.
    "cpu-targets": dict(sections=("attention",), device="cpu", threads=2, methods=("sdpa", "favor-post", "favor-none"),
                        masks=("causal",), passes=("fwd+bwd",), lengths=(2048, 8192, 16384), budget_s=600.0),
    # Issue 34's GPU tables in one run (a few minutes on an H100): the blocks as imported, the op beside
    # fla's chunk kernels, and eleuther-size LM training in bf16 at ctx 1024 (batch 32) and 8192 (batch 4).
    "gpu-targets": dict(sections=("block", "kernels", "model"), device="cuda", dtypes=("bf16",),
                        lengths=(4096, 16384, 65536), model_size="eleuther", model_contexts=(1024, 8192),
                        model_tokens=32768, model_methods=("softmax", "favor-post", "elu-post"), budget_s=60.0),
    # Issue 36's blocks as imported, beside softmax, the window-only control and each plain block
    # (issue 45's targets: the option's cost over the same block without it, to 16k; docs/gap-closers.md).
    "gap-closers": dict(sections=("block",), lengths=(1024, 2048, 4096, 8192, 16384), repeats=3, budget_s=60.0,
                        block_methods=("softmax", "softmax+window=64", "favor-post", "favor-post+window=64",
                                       "favor-pre", "favor-pre+window=64", "favor-pre+decay=retnet",
                                       "taylor-pre", "taylor-pre+window=64", "elu-pre", "elu-pre+window=64")),
}


def show(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def build_parser() -> argparse.ArgumentParser:
    # Parser: train.py's one-line usage errors (the usage block is 22 lines); no abbreviated flags.
    parser = Parser(
        prog="python -m benchmarks",
        description="Benchmark linattn: attention time and memory vs N beside softmax and peers, "
                    "matmul efficiency, decoding, LM throughput.  Defaults in [brackets]; a preset "
                    "changes them, explicit flags override the preset.")
    parser.add_argument("--preset", choices=PRESETS, default="full",
                        help="; ".join(f"{name}: {show_preset(values)}" for name, values in PRESETS.items()))
    add_flags(parser, fields(Settings), note=lambda spec: "" if spec.default == () or spec.metadata["parse"] is bool
              else f" [{show(spec.default)}]")
    return parser


def show_preset(values: dict) -> str:
    return " ".join(f"{flag_name(key)} {show(value)}" for key, value in values.items()) or "the defaults"


# The settings that only some sections read: given for none of the chosen sections, a flag is a mistake
# (--block-methods with --sections attention), as train.py refuses a flag its task does not read.
SECTION_ONLY = {"methods": ("attention",), "masks": ("attention",), "passes": ("attention",),
                "backends": ("attention", "efficiency"), "chunk_size": ("attention", "efficiency"),
                "lengths": ("attention", "efficiency", "block", "kernels"),
                "decode_contexts": ("decode",), "decode_steps": ("decode",),
                **{name: ("model",) for name in ("model_contexts", "model_tokens", "model_steps", "model_methods",
                                                 "model_size")},
                "block_methods": ("block",), "rounds": ("block",),
                "kernel_methods": ("kernels",), "kernel_features": ("kernels",)}


def parse_settings(argv: list[str] | None = None) -> Settings:
    parser = build_parser()
    preset, _ = parser.parse_known_args(argv)
    parser.set_defaults(**PRESETS[preset.preset])
    args = vars(parser.parse_args(argv))
    del args["preset"]
    settings = Settings(**args)
    try:
        check_flags_read(given_flags(parser, argv), settings.sections)
        return resolve(settings)
    except BadSetting as error:
        parser.error(str(error))


def given_flags(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The settings named on the command line, not by the preset or the defaults.

    Args: parser: `build_parser`'s; argv: the arguments (None: sys.argv's).
    Returns: the names of the Settings fields whose flags were given (argparse leaves an attribute the
        namespace already holds unless its flag is given)."""
    unset = object()
    probe = parser.parse_args(argv, argparse.Namespace(**{spec.name: unset for spec in fields(Settings)}))
    return {spec.name for spec in fields(Settings) if getattr(probe, spec.name) is not unset}


def check_flags_read(given: set[str], sections: tuple[str, ...]) -> None:
    """Refuse a flag given for sections that none of the chosen ones is (SECTION_ONLY)."""
    for name in sorted(given & set(SECTION_ONLY)):
        readers = SECTION_ONLY[name]
        if not set(readers) & set(sections):
            raise BadSetting(f"{flag_name(name)} is read only by the {', '.join(readers[:-1])}"
                             f"{' or ' if len(readers) > 1 else ''}{readers[-1]} section, not by --sections "
                             f"{','.join(sections)}: add one of them to --sections, or drop the flag")


def resolve(settings: Settings) -> Settings:
    """Device-dependent defaults filled in; methods that exist; an output place that can be written."""
    try:
        device = resolve_device(settings.device)
    except ValueError as error:
        raise BadSetting(f"--device: {error}") from None
    check_sizes_fit(settings, settings.lengths or DEFAULT_LENGTHS[device.type], device)
    known = [m.name for m in method_table(settings.backends)]
    unmatched = [p for p in settings.methods if not fnmatch.filter(known, p)]
    if unmatched:
        raise BadSetting(f"--methods {','.join(unmatched)} matches no method; with --backends "
                         f"{','.join(settings.backends)} the methods are: {', '.join(known)}")
    check_methods_run_here(settings, device)
    check_methods_build(settings, device)
    uneven = [c for c in settings.model_contexts if settings.model_tokens % c]
    if "model" in settings.sections and uneven:
        raise BadSetting(f"--model-tokens {settings.model_tokens} is not a whole number of sequences at context(s) "
                         f"{','.join(map(str, uneven))}: the model section trains the same tokens per batch at every "
                         "context, so give a multiple of every --model-contexts length")
    out = Path(settings.out)
    try:   # the folder of a run that will start anyway, and a probe that it takes files
        out.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out.parent).close()
    except OSError as error:   # mkdir over a file says "File exists": the file is what is in the way
        blocking = next((folder for folder in (out.parent, *out.parent.parents) if folder.is_file()), None)
        why = f"{blocking} is a file, not a folder" if blocking else error.strerror
        raise BadSetting(f"--out {settings.out}: cannot write into {out.parent} ({why}); "
                         "give a writable file prefix such as bench_results/bench") from None
    if out.is_dir():
        raise BadSetting(f"--out {settings.out} is a folder; give a file prefix such as {out / 'bench'}")
    outputs = [out.with_name(out.name + suffix) for suffix in (".json", ".md", ".png")]
    folders = [path.name for path in outputs if path.is_dir()]
    if folders:   # found now, not when the results are written at the end
        raise BadSetting(f"--out {settings.out}: {', '.join(folders)} is a folder, where the results would be "
                         "written; give another --out")
    earlier = [path.name for path in outputs if path.exists()]
    if earlier and not settings.overwrite:
        raise BadSetting(f"--out {settings.out}: {', '.join(earlier)} from an earlier run would be replaced; "
                         "pass --overwrite to replace them, or give another --out")
    return replace(settings, device=str(device), lengths=settings.lengths or DEFAULT_LENGTHS[device.type])


def check_sizes_fit(settings: Settings, lengths: tuple[int, ...], device: torch.device) -> None:
    """The attention sections' inputs at the longest length (q, k of M features and v of D, float32)
    and the FAVOR+ projection (M x D) fit the device's memory: beyond it every configuration would be
    an allocation-error row, or the first build a traceback."""
    if not set(settings.sections) & {"attention", "efficiency", "decode", "block", "kernels"}:
        return
    m, d = max((settings.num_features, *(settings.kernel_features if "kernels" in settings.sections else ()))), \
        settings.head_dim
    needed = 4 * (settings.batch * settings.heads * max(lengths) * (2 * max(m, d) + d) + m * d)
    available = linattn.device_memory(device)
    if available is not None and needed > available:
        raise BadSetting(f"--lengths up to {max(lengths):,} with b={settings.batch}, h={settings.heads}, D={d}, "
                         f"M={m}: the inputs alone need {needed / 2**30:,.1f} GiB, this {device.type} has "
                         f"{available / 2**30:,.1f} GiB; choose shorter --lengths or smaller sizes")


def selected_methods(settings: Settings) -> list[Method]:
    """The methods whose names match a --methods pattern, in table order."""
    return [m for m in method_table(settings.backends)
            if any(fnmatch.fnmatchcase(m.name, pattern) for pattern in settings.methods)]


def check_methods_run_here(settings: Settings, device: torch.device) -> None:
    """Each --methods item can run here: a name, or a pattern matching only methods that cannot (a cpp
    backend that does not build, a CUDA-only method on the CPU), is refused before anything runs, so
    that a run never ends having skipped what it was asked for and replaced earlier results without
    it.  Methods that a pattern matches beside runnable ones are skipped with a note, as before."""
    if "attention" not in settings.sections:
        return
    table = method_table(settings.backends)
    for pattern in settings.methods:
        reasons = {m.name: unavailable(m, device) for m in table if fnmatch.fnmatchcase(m.name, pattern)}
        if reasons and all(reasons.values()):
            name, reason = next(iter(reasons.items()))
            raise BadSetting(f"--methods {pattern}: {name} cannot run here ({reason}); drop it or fix what it needs")


def check_methods_build(settings: Settings, device: torch.device) -> None:
    """Every selected method that can run here accepts the shape and chunk settings (an odd M with a
    rotation, say), checked once with one head on the CPU rather than as an error row per config;
    so does causal favor-post, which the efficiency and decode sections always run, and every block of
    the block and model sections."""
    shape = replace(settings.shape, heads=1)
    builds = [(method, settings.masks) for method in selected_methods(settings)] if "attention" in settings.sections else []
    if set(settings.sections) & {"efficiency", "decode"}:
        builds.append((next(m for m in method_table(settings.backends) if m.name.startswith("favor-post")),
                       ("causal",)))
    for method, masks in builds:
        if unavailable(method, device) is not None:
            continue   # the sweep notes why it is skipped
        for mask in masks:
            try:
                build_attention(method, shape, torch.device("cpu"), MASKS[mask], settings.chunk_size)
            except (ValueError, TypeError, RuntimeError, MemoryError) as error:   # RuntimeError: an allocation
                raise BadSetting(f"method {method.name} ({mask}) cannot run with these settings: "
                                 f"{first_line(error)}") from None
    lm = model_size(settings.model_size)
    for section, flag, chosen, (dim, heads) in (
            ("block", "--block-methods", settings.block_methods, (settings.heads * settings.head_dim, settings.heads)),
            ("model", "--model-methods", settings.model_methods, (lm["d_model"], lm["n_head"]))):
        for name in chosen if section in settings.sections else ():
            try:   # the block, and a linear one's backend on this device (backend='fla' on CPU, say)
                block = build_block(name, dim, heads, settings.num_features)
                if isinstance(block, linattn.LinearAttention):
                    linattn.resolve_backend(block.backend, device, log_space=block.feature_map.log_space)
            except (ValueError, TypeError, RuntimeError, MemoryError, ImportError) as error:   # Import: xformers
                raise BadSetting(f"{flag} {name} cannot run with these settings: {first_line(error)}") from None
    odd = [m for m in settings.kernel_features if m % 2]
    if "kernels" in settings.sections and odd:
        raise BadSetting(f"--kernel-features {','.join(map(str, odd))}: the kernels section's op rotates pairs of "
                         "features (rope post), so every M must be even")
