"""gemma-nb: the Gemma-4-26B-A4B on inf2.xlarge story, as code the notebooks import.

Modules, one concern each. A notebook's title names its modules: the library a port would copy
first, then the notebook's own experiment around it.

- ``paths``, ``targets``, ``metrics``, ``plots``, ``display``, ``story``: the plumbing every notebook shares
  (``paths`` finds the project from the working directory; ``targets.torch_threads`` is the one thread
  limiter; ``display.setup_page`` sizes tables and figures for the page; ``story`` holds the claims
  with their ranges, ``docs/sources.md`` their sources).
- ``formats``: the weight formats (bf16, int8, fp8, MXFP4, NVFP4), their bytes and quantizer: one
  registry the planner and the quantizers read (01, 02).
- ``experts``: the routed experts, one family: dense or sparse, float, int8 or quantized (02, 05, 07).
- 01 memory arithmetic: ``memory`` (inventory, per-rank byte plans), ``hardware`` (instances, devices),
  ``memory_figures`` (the story's memory figures computed, and the plots).
- 02 quantization: ``quant`` (quantized linears and schemes on a model), ``quant_eval`` (scoring a scheme).
- 03 lm_head sharding: ``parallel`` (the vocab-parallel head and its jobs), ``ranks`` (``run_tp``:
  real gloo ranks in processes).
- 04 compile: ``export`` (the two exported steps, their runner and artifact format), ``compile_cost``
  (the size sweep, its fits and boxes; ``python -m gemma_nb.experiments.compile_run``), ``hostmem`` (RSS sampler).
- 05 slim deploy: ``deploy`` (``python -m gemma_nb.experiments.slim_deploy``).
- 06 embedding scale: ``embedding`` (``HostEmbedding`` and its file), ``embedding_scale`` (the three host paths).
- 07 decode benchmark: ``moe`` (swapping experts into a model), ``bench`` (timing), ``decode_roofline``
  (bytes and FLOPs per decode step at any batch, the planner's decode model too), ``decode_batch``
  (the batch sweep: real routing, timings, crossovers), ``endpoint_bench`` (which server the endpoint
  section measures, its summary, metrics and figure).
- ``tiny``, ``evaluate``, ``modelio``: the bundled checkpoint, how answers are scored, how models load.
- ``runner``: ``python -m gemma_nb run``.
- ``serving``: ``python -m gemma_nb serve`` and the client benchmark, one sub-package: ``serving.runtimes``
  (the model behind it, and one generation: sampling, stop strings), ``serving.schema`` (request and
  response bodies, errors), ``serving.app`` (admission, the queue, the routes), ``serving.serve`` (the
  command, uvicorn's limits), ``serving.client_bench`` (TTFT, ITL, tok/s of any OpenAI-compatible endpoint).
- ``planner``, ``preflight``, ``runbook``: ``python -m gemma_nb plan | preflight | runbook`` (docs/inf2.md);
  ``plan_input`` reads a config for ``plan`` and names what it cannot model.
- ``neuron``: the same steps on the Neuron SDK (imported only for the neuron target).
- ``rehearsal``: the neuron steps on a cpu: NxD stand-ins, an emulation of the SDK surface, the TP=2 and
  XLA checks, and ``make rehearse`` (``python -m gemma_nb.rehearsal``); ``neuron`` never imports it.

``python -m gemma_nb.experiments.compile_run`` and ``python -m gemma_nb.experiments.slim_deploy`` are the two commands a notebook
starts in a fresh process (so their peak RSS is their own); each prints one JSON object on its last
stdout line, as its module docstring documents.
"""

__version__ = "0.1.0"

import warnings as _warnings

# tqdm.auto (imported by transformers) warns when ipywidgets is absent, printing an absolute
# site-packages path on stderr: noise in every notebook and a machine-specific nbval output.
_warnings.filterwarnings("ignore", message="IProgress not found")
