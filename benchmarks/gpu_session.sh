#!/usr/bin/env bash
# One prepared GPU check (issue 31): the environment, the secret-noise kernel and the step table of
# ResNet-18-GN, GPT-2 fp32 and GPT-2 bf16, as JSON under $OUT (or --out DIR). benchmarks/gpu_session.py
# says what it runs; docs/gpu.md ("A GPU session") how to carry its wheels.
#
#   bash benchmarks/gpu_session.sh                              # on one H100/H200, ≤ 8 minutes
#   bash benchmarks/gpu_session.sh --device cpu --tiny --out d  # the same code on a CPU (the test suite)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then  # the carried wheels (docs/gpu.md): installed offline
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/tunefree-site .whl/*.whl
    export PYTHONPATH=/tmp/tunefree-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu_session.py "$@"
