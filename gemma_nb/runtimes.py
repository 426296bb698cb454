"""The model behind ``python -m gemma_nb serve``: one runtime per way of running it.

Every runtime keeps the small protocol ``gemma_nb.generation.Runtime``: a tokenizer,
``prefill(prompt_ids)`` and ``decode(token_id)`` returning next-token logits.

- ``DeployRuntime``: the slim deploy of notebook 05 (``gemma_nb.deploy``: host embedding,
  int8-squeezed exported steps; its one-token decode reads only the routed experts). The cpu default.
- ``TransformersRuntime``: any transformers causal LM, eager; starts in seconds; the cuda default.
- ``NeuronDeployRuntime``: the port's NxD deploy on an inf2, read from one artifact folder
  (``gemma_nb.neuron.artifact``); written against its cpu-tested graph interface, not run here.

``load_runtime`` picks and loads one; ``gemma_nb.serve`` puts it behind HTTP.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import torch

from gemma_nb import deploy, export
from gemma_nb.export import new_kv_cache
from gemma_nb.generation import Runtime
from gemma_nb.modelio import hf_token, load_model, resolve_model_id
from gemma_nb.neuron.build import host_logits, step_inputs
from gemma_nb.neuron.deploy import slim_deploy
from gemma_nb.targets import check_target, torch_device
from gemma_nb.tiny import BUNDLED_ID

log = logging.getLogger("gemma_nb.serve")


def _eos_ids(*sources) -> frozenset[int]:
    ids: set[int] = set()
    for source in sources:
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return frozenset(ids)


class TransformersRuntime:
    """A transformers causal LM (``model(input_ids, cache=...)``) with its own KV cache."""

    def __init__(self, model, tokenizer, max_context: int | None = None):
        from transformers import DynamicCache

        self.model, self.tokenizer = model, tokenizer
        model_limit = getattr(model.config, "max_position_embeddings", None) or max_context
        self.max_context = _context_limit(max_context, model_limit)
        generation_config = getattr(model, "generation_config", None)
        self.eos_token_ids = _eos_ids(getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id)
        self._device = next(model.parameters()).device
        self._new_cache = lambda: DynamicCache(config=model.config)
        self._cache = None

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> torch.Tensor:
        input_ids = torch.tensor([ids], dtype=torch.long, device=self._device)
        out = self.model(input_ids=input_ids, cache=self._cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float().cpu()

    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        self._cache = self._new_cache()
        return self._forward(list(prompt_ids))

    def decode(self, token_id: int) -> torch.Tensor:
        if self._cache is None:
            raise RuntimeError("decode() before prefill(): start a sequence with prefill(prompt_ids)")
        return self._forward([token_id])


class DeployRuntime:
    """The slim deploy (``gemma_nb.deploy.SlimDeploy``): host embedding -> compiled prefill / decode steps.

    ``runner`` is the deploy's ``gemma_nb.export.StepRunner`` (its two programs, weights, host
    embedding and KV-cache shapes); this drives it one step at a time, as ``StepRunner.generate``
    does in one loop, so the server can sample, stream and stop between tokens. The prefill runs
    on a fixed bucket of ``max_prompt_tokens`` positions; the cache holds ``max_cache_len``.
    """

    def __init__(self, runner, tokenizer, max_context: int | None = None, eos_token_ids=None):
        self.runner, self.tokenizer = runner, tokenizer
        self.max_context = _context_limit(max_context, runner.shapes.max_cache_len)
        self.max_prompt_tokens = min(runner.shapes.prefill_len, self.max_context - 1)
        self.eos_token_ids = _eos_ids(eos_token_ids, tokenizer.eos_token_id)
        self._new_cache = lambda: new_kv_cache(runner.kv_shapes, runner.dtype)
        self._kv, self._position = None, 0

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        runner, count = self.runner, len(prompt_ids)
        if not 0 < count <= self.max_prompt_tokens:
            raise ValueError(f"a prompt of {count} tokens; the compiled prefill takes 1 to {self.max_prompt_tokens}")
        self._kv = self._new_cache()
        padded = torch.full((1, runner.shapes.prefill_len), runner.pad_token_id, dtype=torch.long)
        padded[0, :count] = torch.tensor(list(prompt_ids))
        logits = runner.prefill(runner.weights, self._kv, runner.embed(padded), torch.tensor([0]), torch.tensor([count - 1]))
        self._position = count  # where the first generated token goes
        return logits.float().reshape(-1)

    @torch.inference_mode()
    def decode(self, token_id: int) -> torch.Tensor:
        if self._kv is None:
            raise RuntimeError("decode() before prefill(): start a sequence with prefill(prompt_ids)")
        if self._position >= self.runner.shapes.max_cache_len:
            raise ValueError(f"the KV cache of {self.runner.shapes.max_cache_len} positions is full")
        runner = self.runner
        logits = runner.decode(runner.weights, self._kv, runner.embed(torch.tensor([[int(token_id)]])),
                               torch.tensor([self._position]), torch.tensor([0]))
        self._position += 1
        return logits.float().reshape(-1)


class NeuronDeployRuntime:
    """The port's deploy on Inferentia2 (``gemma_nb.neuron.deploy.slim_deploy``), one step at a time.

    ``runner`` is the ``NeuronStepRunner`` (compiled graph, host embedding, config, KV length
    ``max_len`` and prefill ``bucket``); its KV cache is device state that each step updates in
    place, so a new prefill simply overwrites it. NOT RUN HERE on an inf2: the tests drive it over
    the cpu variant of the traced module (``gemma_nb.neuron.deploy.CpuStateGraph``).
    """

    def __init__(self, runner, tokenizer, max_context: int | None = None, eos_token_ids=None):
        self.runner, self.tokenizer = runner, tokenizer
        self.max_context = _context_limit(max_context, runner.max_len)
        self.max_prompt_tokens = min(runner.bucket, self.max_context - 1)
        self.eos_token_ids = _eos_ids(eos_token_ids, tokenizer.eos_token_id)
        self._position = None

    @torch.inference_mode()
    def _step(self, ids: torch.Tensor, positions: list[int], last_index: int) -> torch.Tensor:
        runner = self.runner
        inputs = step_inputs(runner.embed(ids), positions, runner.max_len, runner.config.sliding_window, last_index)
        return host_logits(runner.graph(*inputs), runner.config).reshape(-1)

    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        bucket, count = self.runner.bucket, len(prompt_ids)
        if not 0 < count <= self.max_prompt_tokens:
            raise ValueError(f"a prompt of {count} tokens; the compiled prefill takes 1 to {self.max_prompt_tokens}")
        padded = torch.full((1, bucket), self.runner.pad_token_id, dtype=torch.long)
        padded[0, :count] = torch.tensor(list(prompt_ids))
        # Padding slots are rewritten by later decode steps before any query can see them.
        logits = self._step(padded, list(range(bucket)), count - 1)
        self._position = count
        return logits

    def decode(self, token_id: int) -> torch.Tensor:
        if self._position is None:
            raise RuntimeError("decode() before prefill(): start a sequence with prefill(prompt_ids)")
        logits = self._step(torch.tensor([[int(token_id)]]), [self._position], 0)
        self._position += 1
        return logits


def _context_limit(requested: int | None, model_limit: int | None) -> int:
    if model_limit is None and requested is None:
        raise ValueError("the model does not say how long its context is: pass max_context (--max-context N)")
    if requested is None:
        return int(model_limit)
    if requested < 2:
        raise ValueError(f"max_context={requested} is too small: a prompt and one new token need at least 2")
    if model_limit is not None and requested > model_limit:
        raise ValueError(
            f"max_context={requested} exceeds the model's {model_limit} positions; "
            f"pass --max-context {model_limit} or less"
        )
    return int(requested)


RUNTIMES = ("auto", "deploy", "transformers")
DEFAULT_PREFILL_LEN = 128  # the port's shipped build: prefill bucket 128, KV cache 512


def load_runtime(target: str = "cpu", model_id: str | None = None, *, max_context: int | None = None,
                 runtime: str = "auto", artifact: str | None = None, prefill_len: int = DEFAULT_PREFILL_LEN,
                 dtype: torch.dtype = torch.float32) -> Runtime:
    """Load ``model_id`` for ``target`` behind the ``Runtime`` protocol.

    ``runtime="deploy"`` is the slim deploy of notebook 05 (``gemma_nb.deploy.SlimDeploy``): the
    compiled ``artifact`` folder if given, else ``model_id`` int8-squeezed and compiled into a
    temporary folder first (removed at exit). ``"transformers"`` loads the model with
    ``gemma_nb.modelio.load_model`` onto the target's torch device, unquantized, and starts in
    seconds. ``"auto"`` is deploy on cpu, transformers on cuda. Compiling at start-up takes ~30 s
    for the tiny checkpoint on a busy 2-core box (notebook 04 measures how it grows).
    """
    check_target(target)
    model_id = model_id or BUNDLED_ID
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
    if target == "neuron":
        if runtime == "transformers" or artifact is None:
            raise ValueError(
                "the neuron target serves the compiled NxD artifact: pass --artifact <folder> written by "
                "gemma_nb.neuron.build.compile_neuron (notebook 04); it holds the tokenizer and config too"
            )
        return load_neuron_runtime(model_id, artifact, max_context=max_context)
    if runtime == "auto":
        runtime = "deploy" if target == "cpu" else "transformers"
    if runtime == "deploy":
        if target != "cpu":
            raise ValueError(f"runtime 'deploy' runs the cpu artifact of gemma_nb.export; on {target} use --runtime transformers")
        return load_deploy_runtime(model_id, artifact=artifact, max_context=max_context, prefill_len=prefill_len)

    model, tokenizer = load_model(model_id, dtype=dtype, device=torch_device(target))
    return TransformersRuntime(model, tokenizer, max_context)


def compile_for_serving(model_id: str, folder: str, max_cache_len: int, prefill_len: int) -> None:
    """The deploy's artifact for ``model_id``: full model on the host, int8 squeeze, export (notebooks 04/05)."""
    model = deploy.load_full_model(model_id)
    deploy.int8_squeeze(model)
    shapes = export.StepShapes(max_cache_len=max_cache_len, prefill_len=min(prefill_len, max_cache_len))
    export.compile_model(model, folder, shapes, scheme=deploy.SQUEEZE)


def _tokenizer_and_eos(model_id: str):
    from transformers import AutoTokenizer, GenerationConfig

    source = resolve_model_id(model_id)
    token = None if os.path.isdir(source) else hf_token()
    tokenizer = AutoTokenizer.from_pretrained(source, token=token, trust_remote_code=False)
    try:  # Gemma's chat models also end a turn with <end_of_turn>, listed in generation_config.json
        eos = GenerationConfig.from_pretrained(source, token=token).eos_token_id
    except OSError:
        eos = None
    return source, tokenizer, eos


def load_neuron_runtime(model_id: str, artifact: str, *, max_context: int | None = None) -> NeuronDeployRuntime:
    """The port's slim deploy on Inferentia2 (NOT RUN HERE): everything, tokenizer included, from the
    artifact folder (``gemma_nb.neuron.artifact``); ``model_id`` is only the served name."""
    _, tokenizer, eos = _tokenizer_and_eos(artifact)
    runner, figures = slim_deploy(artifact)
    log.info("NEFF loaded in %.1f s; host embedding in %.1f s", figures["neff_load_s"], figures["embedding_load_s"])
    return NeuronDeployRuntime(runner, tokenizer, max_context, eos_token_ids=eos)


def load_deploy_runtime(model_id: str, *, artifact: str | None = None, max_context: int | None = None,
                        prefill_len: int = DEFAULT_PREFILL_LEN) -> DeployRuntime:
    """The slim deploy of ``artifact`` (or of ``model_id``, compiled now), with ``model_id``'s tokenizer."""
    import atexit
    import shutil
    import tempfile

    from transformers import AutoConfig

    source, tokenizer, eos = _tokenizer_and_eos(model_id)
    if artifact is None:
        limit = getattr(AutoConfig.from_pretrained(source, trust_remote_code=False), "max_position_embeddings", None)
        cache_len = _context_limit(max_context, limit)
        artifact = tempfile.mkdtemp(prefix="gemma-nb-serve-")
        atexit.register(shutil.rmtree, artifact, ignore_errors=True)
        started = time.perf_counter()
        compile_for_serving(model_id, artifact, cache_len, prefill_len)
        log.info("compiled %s for the slim deploy in %.1f s", model_id, time.perf_counter() - started)
    slim = deploy.SlimDeploy(artifact)
    return DeployRuntime(slim.runner, tokenizer, max_context, eos_token_ids=eos)
