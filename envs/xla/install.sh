#!/bin/sh
# The xla environment: envs/xla/requirements.txt into the venv whose python is $1, run from the
# repository root. It needs about NEED_GB of free disk; it stops before installing anything when the
# disk has less, and installs the CUDA libraries one wheel at a time to keep the peak low.
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
"$PY" -m pip install --quiet --upgrade pip
grep -E '^[a-z]' envs/xla/cuda-libs.txt | while read -r lib; do
    "$PY" -m pip install --quiet --no-deps "$lib"
done
"$PY" -m pip install --quiet -r envs/xla/requirements.txt
"$PY" -m pip install --quiet --no-deps -e .
