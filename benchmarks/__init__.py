"""Benchmarks for linattn, run with `python -m benchmarks` (`--help` lists the flags).

methods.py   what is measured: the attention methods as data, and the calls that time them
timing.py    how: timers, peak memory, a fresh process per config, the time budget
sections.py  attention, efficiency, decode and model sections
report.py    tables, slopes, crossovers, the issue's targets, OUT.json and OUT.md
plots.py     the scaling plot, OUT.png
settings.py  the settings, presets and generated flags
"""
