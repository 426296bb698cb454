#!/bin/sh
# The main environment (.venv): the package and the extras $2 (e.g. cpu,dev) into the venv whose
# python is $1, run from the repository root. pip installs pip, uv (envs/uv.txt) and the `cpu`
# extra's torch: the CPU wheel that this machine's pip configuration points at, which uv would not
# see (it reads no pip.conf) and would replace with PyPI's multi-GB CUDA build. uv installs the rest,
# downloading and unpacking in parallel: 74 s (95 s of cpu) on a 2-core box, where pip alone took
# 125 s (120 s of cpu).
set -eu
PY="$1"
EXTRAS="$2"
export PIP_NO_CACHE_DIR=1
"$PY" -m pip install --quiet --upgrade pip -r envs/uv.txt
case ",$EXTRAS," in
*,cpu,*)
    "$PY" -m pip install --quiet $("$PY" -c "import tomllib
print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['cpu'])")
    ;;
esac
# uv's cache and bytecode as in envs/xla/install.sh
cache="$("$PY" -c 'import sys; print(sys.prefix)')/.uv-cache"
"$PY" -m uv pip install --quiet --python "$PY" --cache-dir "$cache" --compile-bytecode -e ".[$EXTRAS]"
rm -rf "$cache"
