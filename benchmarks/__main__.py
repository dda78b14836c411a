"""python -m benchmarks: run the chosen sections, print their tables, write OUT.json/.md/.png."""
from __future__ import annotations

import os
import platform
import sys
import time
from importlib import metadata
from dataclasses import asdict
from pathlib import Path

import torch

import linattn

from .report import Report, write_outputs
from .block import run_block
from .kernels import run_kernels
from .sections import run_attention, run_decode, run_efficiency, run_model
from .settings import Settings, parse_settings, selected_methods
from .timing import ChildRunner


def machine_info(device: torch.device) -> dict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), platform.processor())
    versions = {}
    for key, distribution in (("triton", "triton"), ("fla", "fla-core")):   # read without importing them
        try:
            versions[key] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            pass
    return {"device": str(device), "name": name, "torch": torch.__version__, **versions,
            "python": platform.python_version(), "cpus_allowed": len(os.sched_getaffinity(0)),
            "torch_default_threads": torch.get_num_threads()}


ALLOCATOR = {False: "as imported: no allocator or other process-wide setting",
             True: "glibc keeps freed memory (--keep-freed-memory, as in train.py)"}


def header(settings: Settings, machine: dict) -> str:
    threads = settings.threads or f"torch's default, {machine['torch_default_threads']}"
    return "\n".join([
        f"# linattn benchmark ({time.strftime('%Y-%m-%d %H:%M')})\n",
        f"device: {machine['device']} ({machine['name']}), torch {machine['torch']}"
        + "".join(f", {package} {machine[package]}" for package in ("triton", "fla") if package in machine)
        + f", threads: {threads} "
        f"(of {machine['cpus_allowed']} CPUs allowed); " + ALLOCATOR[settings.keep_freed_memory],
        f"attention: b={settings.batch}, h={settings.heads}, D={settings.head_dim}, M={settings.num_features}, "
        f"causal chunk C={settings.chunk_size}, dtypes {','.join(settings.dtypes)}, "
        f"masks {','.join(settings.masks)}, passes {','.join(settings.passes)}",
        f"methods: {', '.join(m.name for m in selected_methods(settings))} (linattn's auto backend here: "
        f"{linattn.resolve_backend('auto', machine['device'])})",
        f"timing: median of {settings.repeats} after {settings.warmup} warm-up, each config in a fresh "
        f"process; budget {settings.budget_s:g} s per config; sections: {','.join(settings.sections)}"])


def main(argv: list[str] | None = None) -> dict:
    settings = parse_settings(argv)
    device, out = torch.device(settings.device), Path(settings.out)
    plot = out.with_name(out.name + ".png")
    machine = machine_info(device)
    results: dict = {"machine": machine, "settings": asdict(settings)}
    report = Report()
    report.add(header(settings, machine))
    started = time.perf_counter()
    runner = ChildRunner(keep_freed_memory=settings.keep_freed_memory)
    records: list[dict] = []

    def save() -> None:
        """Each section's results are written as soon as it ends, so a later failure loses none of
        them, once this run has measured something: a run in which everything failed or was skipped
        never replaces an earlier run's results.  An earlier run's plot (--overwrite) goes with its
        JSON and report: this run's results would otherwise sit beside a plot of other measurements."""
        if not measured_anything(results):
            return
        write_outputs(out, results, report)
        if settings.overwrite and not plotted(records):
            plot.unlink(missing_ok=True)

    if "attention" in settings.sections:
        results["attention"] = run_attention(settings, device, runner, report)
        records = results["attention"]["records"]
        if plotted(records):
            from .plots import plot_scaling
            plot_scaling(records, plot)
        save()
    later_sections = {"efficiency": lambda: run_efficiency(settings, device, runner, report, records),
                      "decode": lambda: run_decode(settings, device, runner, report),
                      "model": lambda: run_model(settings, device, runner, report),
                      "block": lambda: run_block(settings, device, runner, report),
                      "kernels": lambda: run_kernels(settings, device, runner, report)}
    for name, run in later_sections.items():
        if name in settings.sections:
            results[name] = run()
            save()
    if not measured_anything(results):   # every configuration failed or was skipped: not a success
        errors = [r["error"] for r in records if "error" in r]
        cause = f"every configuration of the attention sweep failed, the first with: {errors[0]}" if errors else \
            "nothing was measured (every configuration failed or was skipped: see the rows above)"
        print(f"error: {cause}; nothing was written, so {out}.json and {out}.md are as they were", file=sys.stderr)
        raise SystemExit(1)
    results["elapsed_s"] = time.perf_counter() - started
    save()
    print(f"\nresults: {out}.json, {out}.md" + (f", {plot}" if plotted(records) else "")
          + f"; total {results['elapsed_s']:.0f} s")
    return results


MEASURED_KEYS = ("elapsed_s", "train_s", "forward_s", "step_s", "prefill_s", "seconds")


def measured_anything(value) -> bool:
    """Whether the results hold a measurement: a record with a measured time, in any section."""
    if isinstance(value, dict):
        return any(isinstance(value.get(key), (int, float)) for key in MEASURED_KEYS) or any(
            measured_anything(item) for key, item in value.items() if key not in ("machine", "settings"))
    return isinstance(value, list) and any(measured_anything(item) for item in value)


def plotted(records: list[dict]) -> bool:
    """Whether the attention sweep measured anything to plot (every config may have been skipped)."""
    return any("elapsed_s" in r for r in records)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:   # each finished section was saved as it ended
        print("\ninterrupted: the sections finished before Ctrl-C are in the --out files", file=sys.stderr)
        raise SystemExit(130) from None
