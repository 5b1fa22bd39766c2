#!/usr/bin/env bash
# `make gpu-check` on a GPU machine that has its own Python (3.11 or newer) and torch with CUDA,
# but no package registry.
#
# On a machine with a registry, fetch the wheels for the GPU machine's Python X.Y and platform:
#   pip download --only-binary=:all: --python-version X.Y -d wheels -r bench/gpu-wheels.txt
#   (add --platform manylinux2014_aarch64 for an ARM GPU machine)
# then copy wheels/ and this checkout over, and from the checkout run:
#   bench/gpu_check.sh wheels [bench/gpu_check.py options]
#
# It makes a venv in .muster/gpu-venv that sees the machine's own torch (--system-site-packages),
# installs every wheel into it with --no-deps and this checkout in editable mode (no build
# isolation: nothing is fetched; the package maps muster.worker to worker/ etc., which a plain
# PYTHONPATH would not), then runs bench/gpu_check.py --require-gpu. PYTHON picks the interpreter
# (default python3); VENV= (empty) installs into that interpreter itself instead of a venv.
set -euo pipefail
wheels=${1:?usage: bench/gpu_check.sh WHEEL_DIR [bench/gpu_check.py options]}
wheels=$(cd "$wheels" && pwd)
shift
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=${VENV-.muster/gpu-venv}
if [ -n "$venv" ]; then
    [ -x "$venv/bin/python" ] || "$python" -m venv --system-site-packages "$venv"
    # A python that is itself a venv's (torch installed there, as on the lent GPU machines) has no
    # system site-packages to inherit: the new venv is pointed at its site-packages instead.
    "$python" -c 'import site; print("\n".join(site.getsitepackages()))' \
        > "$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')/muster-base.pth"
    python=$venv/bin/python
fi
"$python" -c 'import torch' || { echo "gpu_check.sh: no torch in $python: install the machine's CUDA build first" >&2; exit 2; }
"$python" -m pip install -q --no-index --no-deps "$wheels"/*.whl
"$python" -m pip install -q --no-index --no-deps --no-build-isolation -e .
exec "$python" bench/gpu_check.py --require-gpu "$@"
