#!/bin/bash
# Download the wheels that a GPU machine without package-registry access needs to run this project:
# Python 3.12, x86-64 (the GPU image ships torch, transformers, msgpack, uvloop, pytest, hypothesis).
# Usage (from the project root, on a machine that reaches the registry):  bash bench/gpu/fetch-wheels.sh [DIR]
# DIR (default .whl) is git-ignored; `make gpu-wheels` runs this.
set -euo pipefail
dir=${1:-.whl}
mkdir -p "$dir"
plat=(--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$dir" \
  uccl==0.1.1 intervaltree==3.2.1 nvidia-cuda-runtime-cu12==12.9.79 pyzmq==27.3.0 \
  pytest-asyncio==1.5.0 ${EXTRA_WHEELS:-}
ls -1 "$dir"
