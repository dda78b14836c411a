"""Evaluate a checkpoint written by train.py (`python eval.py`): bits per byte over a whole split,
or text samples.

    python eval.py runs/linear-favor-post-M64                        # val bpc at the training seq_len
    python eval.py runs/linear-favor-post-M64 --split test --seq-len 256 512 1024 2048 --max-bytes 100000
    python eval.py runs/linear-favor-post-M64 --generate "The " --max-new-tokens 200 --top-k 40
    python eval.py runs/linear-favor-post-M64 --weight-sums --max-bytes 100000   # sum of attention weights
    python eval.py runs/grid-cpu/linear-favor-pre/seed-0 --ar-split   # bpc on recall hits and the rest

bpc uses non-overlapping windows of seq_len bytes: window k reads bytes [kL, kL + L) and predicts
bytes [kL + 1, kL + L], each from the bytes before it in the same window only.  Every byte but the
split's first is predicted exactly once; the last window may be shorter.  This is the standard
non-overlapping evaluation: bytes early in a window see little context, so longer windows score
better when a model can use them (and worse when it cannot extrapolate).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .data import SPLITS, DataError, SequentialWindows, check_window_fits, default_data_dir, load_split
from .preflight import check_backend_runs_on
from .checkpoint import (CheckpointError, checkpoint_path, import_recorded, load_checkpoint, model_from_checkpoint,
                         recorded_digest, saved_precision, saved_section)
from .flags import finite_float, integer
from .cli import DefaultsFormatter, load_imports, one_line_warnings
from .grid_record import AR_SPLIT_KEYS, DIGEST_KEY, FAR_CLASSES, FAR_MATCHES, RESULT_NAME, read_record
from .lm import ByteLM, bits_per_byte, lm_loss, state_size
from .mqar import describe, held_out_lines, held_out_scores
from .ngram import format_reference, reference_bpc
from .device import DTYPES, autocast, keep_freed_memory, resolve_device, resolve_dtype
from .errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE, Parser, is_out_of_memory
from .files import write_atomically
from .scoring import summed_loss
from .settings import TaskConfig
from .text import decode_bytes, encode_text
from .weight_sums import format_rows, linear_blocks, weight_sum_rows


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description="Evaluate bits per byte of a train.py checkpoint, or sample from it.",
                                formatter_class=DefaultsFormatter)
    p.add_argument("checkpoint", type=Path, help="a ckpt.pt, or a run directory that holds one")
    p.add_argument("--split", choices=SPLITS, default="val", help="split to evaluate")
    p.add_argument("--seq-len", type=integer, nargs="+", action="extend",
                   help="window length(s); several values print a length-extrapolation table, and a repeated "
                        "--seq-len adds its values to the list (default: the training seq_len)")
    p.add_argument("--max-bytes", type=integer, help="evaluate only the first N bytes of the split")
    p.add_argument("--batch-size", type=integer, default=8, help="windows per forward pass")
    p.add_argument("--data-dir", help="prepared enwik8 directory (default: the one the run trained on)")
    p.add_argument("--import", dest="imports", metavar="MODULE_OR_FILE", action="append",
                   help="user code to import first (repeatable); the run's recorded --import values are "
                        "imported too when its feature map is not registered yet")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1, mps")
    p.add_argument("--threads", type=integer, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--dtype", choices=DTYPES, help="compute precision, as train.py's --dtype (default: the run's)")
    p.add_argument("--backend", help="attention kernels, as train.py's --backend (speed only; default: the run's, "
                                     "e.g. --backend auto for a run trained with fla on a GPU)")
    p.add_argument("--ar-split", action="store_true",
                   help="bpc on the associative-recall hits (bytes that continue a byte bigram seen earlier in their "
                        "window) and on the rest, beside bpc on all bytes; recorded in the run's result.json when "
                        "it has one and the whole split is scored")
    p.add_argument("--far-window", type=integer, metavar="W",
                   help="with --ar-split, also split the bytes by how far back their nearest copy source lies (a "
                        "bigram's, and an 8-byte match's): near (< W keys back), far (only beyond W: a window of W "
                        "cannot see it) and none (default: the run's --window, if it has one)")
    p.add_argument("--weight-sums", action="store_true",
                   help="instead of bpc, the sum of each query's attention weights in every linear layer (1 for "
                        "pre and none; how far Eq. 19's post drifts from it), over the same windows")
    sample = p.add_argument_group("sampling (instead of bpc)")
    sample.add_argument("--generate", metavar="PROMPT", help="sample a continuation of PROMPT")
    sample.add_argument("--max-new-tokens", type=integer, default=256, help="bytes to sample")
    sample.add_argument("--temperature", type=finite_float, default=1.0, help="softmax temperature (0 = greedy)")
    sample.add_argument("--top-k", type=integer, help="sample among the k most likely bytes only")
    sample.add_argument("--seed", type=integer, default=0, help="sampling seed")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Each range, refused with the flag and the value that is out of it."""
    ranges = [("--seq-len", n, n >= 1, ">= 1") for n in args.seq_len or []] + [
        ("--batch-size", args.batch_size, args.batch_size >= 1, ">= 1"),
        ("--threads", args.threads, 0 <= args.threads <= 4096, "in [0, 4096]"),
        ("--max-bytes", args.max_bytes, args.max_bytes is None or args.max_bytes >= 2,
         ">= 2 (one input and one target byte)"),
        ("--max-new-tokens", args.max_new_tokens, 0 <= args.max_new_tokens <= 2**24, "in [0, 16,777,216]"),
        ("--temperature", args.temperature, args.temperature >= 0, ">= 0"),
        ("--top-k", args.top_k, args.top_k is None or args.top_k >= 1, ">= 1"),
        ("--seed", args.seed, 0 <= args.seed < 2**63, "in [0, 2**63)"),
        ("--far-window", args.far_window, args.far_window is None or args.far_window >= 1, ">= 1")]
    for flag, value, ok, expected in ranges:
        if not ok:
            parser.error(f"{flag} must be {expected}, got {value}")
    repeated = sorted({n for n in args.seq_len or [] if args.seq_len.count(n) > 1})
    if repeated:
        parser.error(f"--seq-len lists {', '.join(map(str, repeated))} more than once; list each length once")
    if args.data_dir == "":
        parser.error("--data-dir must name a directory, got ''; leave it out for the one the run trained on")


SAMPLING_FLAGS = ("--max-new-tokens", "--temperature", "--top-k", "--seed")
SCORING_FLAGS = ("--split", "--seq-len", "--max-bytes", "--batch-size", "--data-dir")


def check_mode_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    """Sampling flags act only with --generate, scoring flags only without: a flag given to the
    other mode would be ignored without a word.  (Flags are never abbreviated, so argv names them.)"""
    given = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
    sampling, scoring = given.intersection(SAMPLING_FLAGS), given.intersection(SCORING_FLAGS)
    if args.generate is None and sampling:
        parser.error(f"{', '.join(sorted(sampling))} apply only with --generate PROMPT (sampling); "
                     "without it eval.py scores bits per byte" + (" or, here, measures attention weights"
                                                                  if args.weight_sums else ""))
    if args.generate is not None and args.weight_sums:
        parser.error("--generate samples text and --weight-sums measures attention weights: pass one of them")
    if args.far_window is not None and not args.ar_split:
        parser.error("--far-window splits --ar-split's scores by distance: add --ar-split, or drop --far-window")
    if args.ar_split and (args.generate is not None or args.weight_sums):
        parser.error("--ar-split scores bits per byte: it does not combine with --generate or --weight-sums")
    if args.generate is not None and scoring:
        parser.error(f"{', '.join(sorted(scoring))} apply to scoring bits per byte, not to --generate; "
                     "drop them, or drop --generate")


def evaluate_bpc(model: ByteLM, data: np.ndarray, seq_len: int, batch_size: int,
                 device: torch.device, dtype: str = "auto") -> tuple[float, float]:
    """(bits per byte, tokens per second) over `data` in non-overlapping windows of seq_len."""
    windows = SequentialWindows(data, batch_size, seq_len)
    start = time.perf_counter()
    nats, count = summed_loss(model, windows, device, dtype)
    seconds = time.perf_counter() - start
    assert count == windows.num_targets, "every byte after the first is predicted exactly once"
    return bits_per_byte(nats / count), count / seconds


def bpc_table(model: ByteLM, data: np.ndarray, seq_lens: list[int], batch_size: int,
              device: torch.device, dtype: str = "auto") -> list[tuple[int, float, float]]:
    """Print and return (seq_len, bpc, tokens/s) rows; nan where learned positions cannot reach."""
    print(f"{'seq_len':>8}  {'bpc':>8}  {'tokens/s':>10}", flush=True)
    rows = []
    for seq_len in seq_lens:
        if beyond_learned_positions(model, seq_len):
            print(f"{seq_len:>8}  {'n/a':>8}  {learned_positions_note(model)}")
            rows.append((seq_len, float("nan"), float("nan")))
            continue
        bpc, rate = evaluate_bpc(model, data, seq_len, batch_size, device, dtype)
        print(f"{seq_len:>8}  {bpc:>8.4f}  {rate:>10,.0f}", flush=True)
        rows.append((seq_len, bpc, rate))
    return rows


def recall_hits(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, N) bool for (B, N) byte inputs and targets: target i continues a byte bigram (x_i, y_i) that
    occurred earlier in its row, at some j < i (both of its bytes are context by then): an associative-
    recall hit, as Zoology splits its data."""
    return copy_distances(x, y, 2) >= 0


def copy_distances(x: torch.Tensor, y: torch.Tensor, length: int) -> torch.Tensor:
    """(B, N) int64 for (B, N) byte inputs and targets: for target i, the distance back from query i to
    the key it could be copied from, i - j - 1, where j < i is the nearest earlier target whose `length`
    bytes (its input bytes x_(j-length+2) .. x_j and itself) equal those ending at target i; the key
    j + 1 holds y_j = y_i as its input.  -1 where there is no such j (or fewer than `length` bytes).
    Exact: the bytes are packed into one 64-bit code (length <= 8) and sorted per row with numpy."""
    rows, width = x.shape
    inputs, targets = x.numpy().astype(np.uint64), y.numpy().astype(np.uint64)
    code = targets.copy()
    for back in range(1, length):   # input byte x_(i-back+1) goes into bits 8*back ..
        code[:, back - 1:] |= inputs[:, :width - back + 1] << np.uint64(8 * back)
    position = np.broadcast_to(np.arange(width), (rows, width))
    row = np.broadcast_to(np.arange(rows)[:, None], (rows, width))
    whole = position >= length - 2   # every byte of the match lies in the row
    code, row, position = code[whole], row[whole], position[whole]
    order = np.lexsort((position, code, row))   # by row, then code, then position
    code, row, position = code[order], row[order], position[order]
    repeat = (code[1:] == code[:-1]) & (row[1:] == row[:-1])
    sorted_distance = np.full(len(order), -1, dtype=np.int64)
    sorted_distance[1:] = np.where(repeat, position[1:] - position[:-1] - 1, -1)
    distance = np.full(rows * width, -1, dtype=np.int64)
    distance[np.flatnonzero(whole.ravel())[order]] = sorted_distance
    return torch.from_numpy(distance.reshape(rows, width))


def distance_classes(distance: torch.Tensor, window: int) -> dict[str, torch.Tensor]:
    """Masks of FAR_CLASSES: the nearest copy source inside the last `window` keys (near), only beyond
    them (far: a window of that size cannot see it), or nowhere in the window of text (none)."""
    return {"near": (distance >= 0) & (distance < window), "far": distance >= window, "none": distance < 0}


@torch.no_grad()
def ar_split_bpc(model: ByteLM, data: np.ndarray, seq_len: int, batch_size: int, device: torch.device,
                 dtype: str = "auto", far_window: int = 0) -> dict[str, Any]:
    """bpc over `data` in eval.py's windows (evaluate_bpc's), on all bytes, on the recall hits
    (recall_hits) and on the rest, and the hits' share of the bytes; a part with no byte scores nan.
    With `far_window` W >= 1, also "far": {"window": W, and per FAR_MATCHES name, each class's bpc and
    share (near_bpc, far_bpc, none_bpc, near_fraction, ...)}: the bytes split by how far back their
    nearest copy source lies (copy_distances, distance_classes)."""
    was_training = model.training
    model.eval()
    parts = {"hit": None, "rest": None} | {f"{name}.{kind}": None for name in FAR_MATCHES for kind in FAR_CLASSES
                                            if far_window}
    sums = torch.zeros(len(parts), 2, dtype=torch.float64)   # part x [nats, bytes]
    try:
        for x, y in SequentialWindows(data, batch_size, seq_len):
            masks = {"hit": recall_hits(x, y)}
            masks["rest"] = ~masks["hit"]
            for name, length in FAR_MATCHES.items() if far_window else ():
                for kind, mask in distance_classes(copy_distances(x, y, length), far_window).items():
                    masks[f"{name}.{kind}"] = mask
            x, y = x.to(device), y.to(device)
            with autocast(device, dtype):
                nats = lm_loss(model(x), y, reduction="none").double().view(y.shape).cpu()
            for row, part in enumerate(parts):
                sums[row] += torch.stack([nats[masks[part]].sum(), masks[part].sum().double()])
    finally:
        model.train(was_training)
    totals = dict(zip(parts, sums.tolist()))
    per_byte = lambda part: bits_per_byte(totals[part][0] / totals[part][1]) if totals[part][1] else math.nan
    share = lambda part: totals[part][1] / (totals["hit"][1] + totals["rest"][1])
    all_nats, all_bytes = (a + b for a, b in zip(totals["hit"], totals["rest"]))
    scores: dict[str, Any] = {"bpc": bits_per_byte(all_nats / all_bytes), "hit_bpc": per_byte("hit"),
                              "rest_bpc": per_byte("rest"), "hit_fraction": share("hit")}
    if far_window:
        scores["far"] = {"window": far_window} | {
            name: {f"{kind}_{what}": value(f"{name}.{kind}") for kind in FAR_CLASSES
                   for what, value in (("bpc", per_byte), ("fraction", share))}
            for name in FAR_MATCHES}
    return scores


def ar_split_table(model: ByteLM, data: np.ndarray, seq_lens: list[int], batch_size: int, device: torch.device,
                   dtype: str = "auto", far_window: int = 0) -> dict[int, dict[str, Any]]:
    """Print and return ar_split_bpc's scores per window length (bpc_table's lengths, n/a alike)."""
    print(f"{'seq_len':>8}  {'bpc':>8}  {'AR-hit bpc':>10}  {'rest bpc':>8}  {'hit share':>9}", flush=True)
    rows = {}
    for seq_len in seq_lens:
        if beyond_learned_positions(model, seq_len):
            print(f"{seq_len:>8}  {'n/a':>8}  {learned_positions_note(model)}")
            continue
        rows[seq_len] = split = ar_split_bpc(model, data, seq_len, batch_size, device, dtype, far_window)
        print(f"{seq_len:>8}  {split['bpc']:>8.4f}  {split['hit_bpc']:>10.4f}  {split['rest_bpc']:>8.4f}  "
              f"{split['hit_fraction']:>9.1%}", flush=True)
        for name in FAR_MATCHES if far_window else ():
            scores = split["far"][name]
            print(f"{'':>8}  {name} source < {far_window} back: " + ", ".join(
                f"{kind} {scores[f'{kind}_bpc']:.4f} bpc ({scores[f'{kind}_fraction']:.1%})" for kind in FAR_CLASSES),
                flush=True)
    return rows


def record_ar_split(path: Path, split: str, rows: dict[int, dict[str, Any]]) -> str | None:
    """Add the AR split to the run's result.json (grid.py's record of the run) beside the checkpoint
    `path`, under ar_split.<split>.<seq_len>, when that record was scored from this very checkpoint (its
    checkpoint_sha256 is the checkpoint's digest); else a record would hold scores of two checkpoints.
    Returns what was done, as a line to print; None where there is no record."""
    record_path = path.parent / RESULT_NAME
    record = read_record(record_path)
    if record is None:
        return None
    if record.get(DIGEST_KEY) is None or record[DIGEST_KEY] != recorded_digest(path):
        return (f"AR split not recorded: {record_path} was not scored from this checkpoint (trained on since, or "
                "written before records named their checkpoint); grid.py --resume scores the run again")
    scores = record.setdefault("ar_split", {}).setdefault(split, {})
    scores.update({str(seq_len): {key: row[key] for key in (*AR_SPLIT_KEYS, "far") if key in row}
                   for seq_len, row in rows.items()})
    write_atomically(record_path, lambda tmp: tmp.write_text(json.dumps(record, indent=1) + "\n"))
    return f"AR split recorded in {record_path}"


def score_mqar_run(model: ByteLM, checkpoint: dict[str, Any], task: TaskConfig, args: argparse.Namespace,
                   device: torch.device) -> str:
    """A --task mqar run's scores on its held-out val and test streams (grid.py's), as text."""
    if (args.seq_len or args.max_bytes or args.data_dir or args.weight_sums or args.ar_split
            or args.generate is not None):
        raise ValueError("this is a --task mqar run, scored on its seeded held-out streams at its own length (its "
                         "tokens are MQAR ids, not text): drop --seq-len, --max-bytes, --data-dir, --weight-sums, "
                         "--ar-split and --generate")
    config = model.config
    batch_size = saved_section(checkpoint["config"], "optim").batch_size
    scores = held_out_scores(model, config.vocab_size, config.seq_len, task.mqar_kv_pairs, task.mqar_filler,
                             batch_size, config.seed, device, args.dtype)
    data = describe(config.vocab_size, config.seq_len, task.mqar_kv_pairs, task.mqar_filler)
    return "\n".join([f"{data}; decoding state {state_size(config)}",
                      *held_out_lines(scores)])


def learned_positions_note(model: ByteLM) -> str:
    """Why a length past learned positions is n/a (the bpc table and --weight-sums say it alike)."""
    return f"learned absolute positions cover {model.config.seq_len} bytes only"


def beyond_learned_positions(model: ByteLM, seq_len: int) -> bool:
    return model.config.abs_pos and seq_len > model.config.seq_len


def check_windows_fit(model: ByteLM, seq_lens: list[int], length: int, *, flag: bool, cut: bool) -> None:
    """The longest window to score fits the `length` bytes, checked before any length is scored (a
    row of the table, then an error, would leave the run half done); lengths past learned positions
    score nothing, so they need no data.  `flag`: --seq-len gave the lengths; `cut`: --max-bytes cut
    the split short."""
    scored = [seq_len for seq_len in seq_lens if not beyond_learned_positions(model, seq_len)]
    if not scored:   # a table of n/a alone: nothing asked for can be scored
        raise ValueError(f"--seq-len {','.join(map(str, seq_lens))}: this model's {learned_positions_note(model)}, so "
                         f"no length asked for can be scored; include one of at most {model.config.seq_len}")
    longest = max(scored)
    check_window_fits(length, longest, asked=f"--seq-len {longest}" if flag else f"the training seq_len {longest}",
                      fix="pass a smaller --seq-len" + (" or a larger --max-bytes" if cut else ""))


def non_finite_scores(model: ByteLM, rows: list[tuple[int, float, float]]) -> list[str]:
    """'seq_len N: bpc' for each score that is NaN or inf (not counting lengths beyond learned positions)."""
    return [f"seq_len {seq_len}: {bpc}" for seq_len, bpc, _ in rows
            if not math.isfinite(bpc) and not beyond_learned_positions(model, seq_len)]


def sample_text(model: ByteLM, args: argparse.Namespace, device: torch.device) -> str:
    try:
        prompt = encode_text(args.generate)
    except UnicodeEncodeError as error:   # undecodable bytes in the shell's argument
        raise ValueError(f"--generate: the prompt is not UTF-8 text ({error.reason} at character {error.start}); "
                         "give the prompt as UTF-8") from None
    if len(prompt) == 0:
        raise ValueError("--generate needs a non-empty prompt")
    fed = len(prompt) + args.max_new_tokens - 1   # the last byte drawn is never fed back
    if beyond_learned_positions(model, fed):   # checked here, where the flags that fix it are known
        raise ValueError(f"--generate: the prompt ({len(prompt)} bytes) and --max-new-tokens {args.max_new_tokens} "
                         f"need {fed} positions, and this model's {learned_positions_note(model)}; give a "
                         "shorter prompt or a smaller --max-new-tokens")
    generator = torch.Generator(device).manual_seed(args.seed)
    with autocast(device, args.dtype):
        new = model.generate(prompt.to(device), args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, generator=generator)
    return args.generate + decode_bytes(new)


def recorded_dtype(checkpoint: dict[str, Any], path: Path | str) -> str:
    """The precision the run trained in: its saved precision (what --dtype resolved to where it
    ran; a damaged entry is refused as --resume refuses it), else its --dtype (checkpoints from
    before --dtype ran as its default, auto)."""
    precision = saved_precision(checkpoint, path)
    if precision is not None:
        return precision
    run = checkpoint["config"].get("run")
    dtype = run.get("dtype", "auto") if isinstance(run, dict) else "auto"
    return dtype if dtype in DTYPES else "auto"


def recorded_data_dir(checkpoint: dict[str, Any]) -> str:
    """The data directory the run trained on, or "" when the checkpoint does not say (or says
    something that is not a path)."""
    run = checkpoint["config"].get("run")
    data_dir = run.get("data_dir") if isinstance(run, dict) else ""
    return data_dir if isinstance(data_dir, str) else ""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    one_line_warnings()
    load_imports(argv)
    args = parser.parse_args(argv)
    check_args(parser, args)
    check_mode_flags(parser, args, sys.argv[1:] if argv is None else argv)
    keep_freed_memory()   # large CPU temporaries reuse freed memory instead of page-faulting
    try:
        device = resolve_device(args.device)
        if args.threads:
            torch.set_num_threads(args.threads)
        path = checkpoint_path(args.checkpoint)
        checkpoint = load_checkpoint(path, map_location="cpu")
        import_recorded(checkpoint, path)
        model = model_from_checkpoint(checkpoint, path, backend=args.backend).to(device).eval()
        config = model.config
        check_backend_runs_on(config, device)   # before any output: --backend fla on CPU, say
        args.dtype = args.dtype or recorded_dtype(checkpoint, path)
        resolve_dtype(args.dtype, device)
        print(f"checkpoint: {path} (step {checkpoint['step']}, {config.variant}, "
              f"{model.num_parameters():,} parameters, trained at seq_len {config.seq_len})")
        task = saved_section(checkpoint["config"], "task")
        task.validate()   # saved_section checks types only: an edited filler would be drawn as another
        if task.task == "mqar":
            print(score_mqar_run(model, checkpoint, task, args, device))
            return 0
        if args.generate is not None:
            print(sample_text(model, args, device))
            return 0
        if args.weight_sums:
            linear_blocks(model)   # a softmax run is refused before any data is read
        data_dir = args.data_dir or recorded_data_dir(checkpoint) or str(default_data_dir())
        split = load_split(data_dir, args.split)
        data = split.data[:args.max_bytes] if args.max_bytes else split.data
        print(f"data: {split.description} from {data_dir}, {args.split} split, "
              f"{len(data):,} of {len(split):,} bytes")
        if split.description != checkpoint["data"]:   # prepared again since, or --data-dir: other bytes
            print(f"note: the run trained on {checkpoint['data']}, not on these data")
        seq_lens = args.seq_len or [config.seq_len]
        check_windows_fit(model, seq_lens, len(data), flag=bool(args.seq_len), cut=len(data) < len(split))
        if args.weight_sums:
            for seq_len in seq_lens:
                if beyond_learned_positions(model, seq_len):
                    print(f"seq_len {seq_len}: n/a, {learned_positions_note(model)}")
                    continue
                rows = weight_sum_rows(model, data, seq_len, args.batch_size, device, args.dtype)
                print(format_rows(rows, seq_len, config.normalization))
            return 0
        if args.ar_split:
            far_window = args.far_window or config.window
            split_rows = ar_split_table(model, data, seq_lens, args.batch_size, device, args.dtype, far_window)
            rows = [(seq_len, row["bpc"], math.nan) for seq_len, row in split_rows.items()]
        else:
            rows = bpc_table(model, data, seq_lens, args.batch_size, device, args.dtype)
        non_finite = non_finite_scores(model, rows)
        if non_finite:
            print(f"error: the model scores non-finite bits per byte ({', '.join(non_finite)}): its outputs overflow "
                  f"on this data, so {path} may be damaged; evaluate an earlier checkpoint", file=sys.stderr)
            return EXIT_ERROR
        print(format_reference(reference_bpc(data_dir, args.split, max_bytes=args.max_bytes)))
        if args.ar_split:
            if args.max_bytes:
                print(f"AR split not recorded: --max-bytes scored part of the {args.split} split")
            elif (recorded := record_ar_split(path, args.split, split_rows)) is not None:
                print(recorded)
    except (CheckpointError, DataError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        print("error: out of memory: choose a smaller --batch-size or --seq-len", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0
