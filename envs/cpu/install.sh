#!/bin/sh
# The main environment (.venv): the package and the extras $2 (e.g. cpu,dev) into the venv whose
# python is $1, run from the repository root. pip installs pip and uv (envs/uv.txt); uv installs the
# rest, downloading and unpacking in parallel. The `cpu` extra's torch is the CPU wheel that this
# machine's pip configuration points at: uv reads no pip.conf and would take PyPI's multi-GB CUDA
# build, so pip names the wheel it would install (a dry run) and uv installs that one.
set -eu
PY="$1"
EXTRAS="$2"
export PIP_NO_CACHE_DIR=1
"$PY" -m pip install --quiet --upgrade pip -r envs/uv.txt
wheels=""
case ",$EXTRAS," in
*,cpu,*)
    wheels=$("$PY" -m pip install --quiet --dry-run --no-deps --ignore-installed --report - \
        $("$PY" -c "import tomllib
print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['cpu'])") |
        "$PY" -c "import json, sys
print(*(f\"{p['metadata']['name']}@{p['download_info']['url']}\" for p in json.load(sys.stdin)['install']))")
    ;;
esac
# uv's cache and bytecode as in envs/xla/install.sh
cache="$("$PY" -c 'import sys; print(sys.prefix)')/.uv-cache"
"$PY" -m uv pip install --quiet --python "$PY" --cache-dir "$cache" --compile-bytecode $wheels \
    -e ".[$EXTRAS]"
rm -rf "$cache"
