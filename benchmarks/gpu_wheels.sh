#!/usr/bin/env bash
# The wheels a lent GPU machine needs beside the torch and triton of its image: it reaches no package
# registry, so they travel in .whl/ (git-ignored) and benchmarks/gpu_session.sh installs them there.
# For the machine's Python 3.12; fla-core at the `gpu` extra's version (pyproject.toml), performer-pytorch
# and its dependencies at the versions this project's CPU install resolves.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
    fla-core==0.6.0 performer-pytorch==1.1.4 local-attention==1.11.2 axial-positional-embedding==0.3.12 \
    hyper-connections==0.4.11 torch-einops-utils==0.2.0
ls .whl
