#!/usr/bin/env bash
# A GPU machine without a package registry (an image with Python 3.12, torch, triton, transformers, numpy,
# pytest, pytest-benchmark, safetensors, matplotlib) lacks what the flashdapo CLI needs (tyro and its
# dependencies) and the baselines of the kernel table (liger-kernel and cut-cross-entropy, pure Python
# over Triton). Download them here as wheels into .whl/ (git-ignored locally) and copy .whl/ along with the
# checkout; bench/gpu_check.sh installs them into /tmp/site when it finds them. pytest-rerunfailures is
# not needed there: pytest's addopts name no plugin option (the rerun is on `make test`'s line).
# pyarrow (parquet data) is left out on purpose (~40 MB): the GPU check trains on the built-in toy task.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "tyro==1.0.17" "docstring-parser" "typeguard" "typing-extensions" "liger-kernel==0.8.5" "cut-cross-entropy==25.1.1"
ls -la .whl
