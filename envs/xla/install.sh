#!/bin/sh
# The xla environment: envs/xla/requirements.txt and the CUDA libraries of envs/xla/cuda-libs.txt
# into the venv whose python is $1, run from the repository root. uv (pip-installed into that venv)
# downloads and unpacks the ~4.5 GB of wheels in parallel: 79 s on a 2-core box, where pip took 193 s.
# It needs about NEED_GB of free disk; it stops before installing anything when the disk has less.
set -eu
PY="$1"
NEED_GB=9
free_gb=$("$PY" -c 'import shutil, sys; print(shutil.disk_usage(sys.prefix).free // 2**30)')
if [ "$free_gb" -lt "$NEED_GB" ]; then
    echo "envs/xla/install.sh: $free_gb GB free on the disk of $("$PY" -c 'import sys; print(sys.prefix)'); the xla environment" >&2
    echo "needs about $NEED_GB GB (torch 2.9.0 from PyPI and its CUDA libraries). Free some space and run make again." >&2
    exit 1
fi
export PIP_NO_CACHE_DIR=1
"$PY" -m pip install --quiet --upgrade pip -r envs/uv.txt
# uv's cache inside the venv, so on its disk: uv hard-links the unpacked files from it instead of
# copying them; removed once installed. Bytecode compiled now, as pip does, for every later import.
cache="$("$PY" -c 'import sys; print(sys.prefix)')/.uv-cache"
"$PY" -m uv pip install --quiet --python "$PY" --cache-dir "$cache" --compile-bytecode \
    -r envs/xla/cuda-libs.txt -r envs/xla/requirements.txt
rm -rf "$cache"
"$PY" -m pip install --quiet --no-deps -e .
