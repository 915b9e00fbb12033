#!/usr/bin/env bash
# Build / download the wheels the GPU image lacks into bench/wheels-gpu/ (gitignored), for
# bench/gpu_learner.sh. The GPU image (docs: /work/shared/DEPENDENCY_NOTES.md) has Python 3.12,
# torch 2.11+cu130, transformers 5.17, triton, numpy, msgpack, psutil, pyyaml, pillow, and no
# package registry. Run on the CPU machine, from the repository root:  bash tools/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=bench/wheels-gpu
mkdir -p "$OUT"
# pure-Python wheels built here: DeepSpeed without its ops, and worldloop itself
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" deepspeed==0.19.8
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" .
# cp312 manylinux wheels of what worldloop's learner imports beyond the image
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$OUT" \
    hjson pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection \
    redis==8.1.0 pyzmq==27.3.0 msgspec==0.22.0 crc32c==2.9.post0 gymnasium==1.4.0 farama-notifications \
    liger-kernel==0.8.5 zstandard==0.25.0
ls -la "$OUT"
du -sh "$OUT"
