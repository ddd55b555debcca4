#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels the server needs on the GPU machine, which
# has torch/triton/tokenizers/safetensors but not these. Carry `.whl` and install there with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64"
for p in fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection msgspec \
         pyzmq openai jiter distro opentelemetry-api importlib-metadata; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .whl "$p"
done
ls .whl
