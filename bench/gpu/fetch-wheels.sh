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
# the peer bench/transfer_mn.py --ckpt runs beside the engine: checkpoint-engine and what it imports
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$dir" \
  checkpoint-engine==0.4.2 loguru==0.7.3 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 fastapi==0.165.0 starlette==1.10.0 typing-extensions==4.16.0 opentelemetry-api==1.45.2 \
  annotated-doc==0.0.7 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 idna==3.20 certifi==2026.10.19.post1 \
  safetensors==0.8.0 uvicorn==0.54.0 click==8.5.1
ls -1 "$dir"
