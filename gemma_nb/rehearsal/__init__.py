"""The inf2 path rehearsed on a cpu: stand-ins of the Neuron SDK, and the runbook run against them.

Never imported by ``gemma_nb.neuron`` (which may be handed an SDK namespace built from these, as
``build_lm_head(sdk=...)`` is); these modules prove this repository's neuron code, not the SDK.

- ``standins`` (with ``nxd_layers``, ``nxd_quant``, ``sharding``): cpu stand-ins of the NxD layers and
  of ModelBuilder's checkpoint path, keeping neuronx-distributed 0.18's contracts; their
  divergences from NxD are listed in ``standins``' docstring.
- ``spmd``, ``nxd_model``, ``nxd_builder`` and ``sdk_path/``: the emulated SDK surface the repo
  calls (``torch_neuronx``, ``neuronx_distributed``, ``neuron-ls``): NeuronCores as threads with real
  collectives and an HBM budget, ModelBuilder v1 / v2, NxDModel, ``torch.jit.load``, runtime close.
  Importable only where ``make rehearse`` puts ``sdk_path/`` on the path.
- ``emulate``: the build's graphs at TP=2 on two gloo ranks, and the bf16 router check (notebook 05).
- ``lowering``: the graphs lowered to XLA at the SDK's torch-xla, in ``.venv-xla`` (notebook 04, tests/xla).
- ``rehearse`` (``python -m gemma_nb.rehearsal``, ``make rehearse``): the runbook's commands in order
  against the emulated SDK; writes ``rehearsal.json``.
"""
