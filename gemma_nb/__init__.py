"""gemma-nb: the Gemma-4-26B-A4B on inf2.xlarge story, as code the notebooks import.

Modules, one concern each (a notebook's title tells you which one it uses):

- ``paths``, ``targets``, ``metrics``, ``plots``, ``display``, ``story``: the plumbing every notebook shares
  (``display.setup_page`` sizes tables and figures for the page; ``docs/sources.md`` backs ``story``).
- ``formats``: the weight formats (bf16, int8, fp8, MXFP4, NVFP4), their bytes and quantizer: one
  registry the planner and the quantizers read (01, 02).
- ``memory``, ``hardware``: parameter inventory, per-rank byte plans, instance catalog (01).
- ``quant``: quantized linears and schemes on a model (02).   ``parallel``: the sharded lm_head (03).
- ``experts``: the routed experts, one family: dense or sparse, float, int8 or quantized (02, 05, 07).
- ``compile``, ``deploy``: export and slim deploy (04, 05).   ``embedding``: the scale fix (06).
- ``moe``, ``bench``: swapping experts into a model, and the decode benchmark (07).
- ``tiny``, ``evaluate``, ``modelio``: the bundled checkpoint and how answers are scored.
- ``runner``, ``serve``: ``python -m gemma_nb run`` and ``python -m gemma_nb serve`` (``serve`` loads
  the model; ``serve_app``, ``serve_http``, ``serve_schema`` answer HTTP; ``generation`` samples tokens).
- ``planner``, ``preflight``, ``runbook``: ``python -m gemma_nb plan | preflight | runbook`` (docs/inf2.md).
"""

__version__ = "0.1.0"

import warnings as _warnings

# tqdm.auto (imported by transformers) warns when ipywidgets is absent, printing an absolute
# site-packages path on stderr: noise in every notebook and a machine-specific nbval output.
_warnings.filterwarnings("ignore", message="IProgress not found")
