#!/bin/sh
# gemma_nb into the Neuron SDK's environment, keeping the SDK's own torch and numpy.
# Run from the repository root with the environment's python active (on the Deep Learning AMI:
# source /opt/aws_neuronx_venv_pytorch_2_9/bin/activate), or pass PYTHON=/path/to/python.
# `pip install -e .` alone would pull pyproject's numpy and pandas over the SDK's: not done here.
set -eu
PYTHON="${PYTHON:-python}"
pins="$("$PYTHON" -c 'import sys, tempfile; print(tempfile.mkdtemp(prefix="gemma-nb-pins-"))')/sdk-pins.txt"
"$PYTHON" -m pip freeze | grep -iE '^(numpy|torch|torch-neuronx|torch-xla|neuronx-cc|neuronx-distributed|libneuronxla)==' > "$pins" || true
echo "keeping the environment's $(tr '\n' ' ' < "$pins")"
"$PYTHON" -m pip install --quiet -c "$pins" -r envs/neuron/notebooks.txt "$@"
"$PYTHON" -m pip install --quiet --no-deps -e .
