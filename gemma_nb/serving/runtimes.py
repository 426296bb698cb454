"""The model behind the server, one ``generation.Runtime`` per way of running it: ``DeployRuntime``, the
slim deploy of notebook 05 (host embedding, int8-squeezed exported steps, from notebook 04's artifact);
``TransformersRuntime``, any transformers causal LM (starts in seconds; the cuda default);
``NeuronDeployRuntime``, the port's NxD deploy on an inf2 (written against its cpu-tested graph
interface, NOT RUN here on Inferentia2).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from gemma_nb import export
from gemma_nb.embedding import HostEmbedding
from gemma_nb.modelio import hf_token, load_model, model_skeleton, resolve_model_id
from gemma_nb.neuron.build import host_logits, step_inputs
from gemma_nb.neuron.deploy import slim_deploy
from gemma_nb.targets import check_target, torch_device
from gemma_nb.tiny import BUNDLED_ID

RUNTIMES = ("auto", "deploy", "transformers")

log = logging.getLogger("gemma_nb.serve")


def _context_limit(requested: int | None, model_limit: int | None) -> int:
    if requested is None and model_limit is None:
        raise ValueError("the model does not say how long its context is: pass max_context (--max-context N)")
    if requested is not None and not 2 <= requested <= (model_limit or requested):
        raise ValueError(f"max_context={requested}: a prompt and one new token need at least 2, and the model holds "
                         f"{model_limit} positions; pass --max-context between 2 and {model_limit}")
    return int(model_limit if requested is None else requested)


class _Runtime:
    def __init__(self, tokenizer, max_context: int, eos_token_ids=None):
        self.tokenizer, self.max_context = tokenizer, max_context
        sources = [eos_token_ids, tokenizer.eos_token_id]
        self.eos_token_ids = frozenset(i for s in sources if s is not None for i in ([s] if isinstance(s, int) else s))


class TransformersRuntime(_Runtime):
    """A transformers causal LM (``model(input_ids, cache=...)``) with its own KV cache."""

    def __init__(self, model, tokenizer, max_context: int | None = None):
        from transformers import DynamicCache

        limit = getattr(model.config, "max_position_embeddings", None) or max_context
        super().__init__(tokenizer, _context_limit(max_context, limit),
                         getattr(getattr(model, "generation_config", None), "eos_token_id", None))
        self.model, self._device = model, next(model.parameters()).device
        self._new_cache, self._cache = (lambda: DynamicCache(config=model.config)), None

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> torch.Tensor:
        input_ids = torch.tensor([ids], dtype=torch.long, device=self._device)
        return self.model(input_ids=input_ids, cache=self._cache, use_cache=True, logits_to_keep=1).logits[0, -1].float().cpu()

    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        self._cache = self._new_cache()
        return self._forward(list(prompt_ids))

    def decode(self, token_id: int) -> torch.Tensor:
        assert self._cache is not None, "decode() before prefill()"
        return self._forward([token_id])


class _Stepped(_Runtime):
    """A compiled deploy stepped one token at a time, so the server can sample, stream and stop between
    tokens: the prompt padded to the fixed prefill ``bucket``, then one token per decode step."""

    def __init__(self, runner, tokenizer, context: int, bucket: int, eos_token_ids=None):
        super().__init__(tokenizer, context, eos_token_ids)
        self.runner, self.bucket, self.max_prompt_tokens, self._position = runner, bucket, min(bucket, context - 1), None

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        if not 0 < len(prompt_ids) <= self.max_prompt_tokens:
            raise ValueError(f"a prompt of {len(prompt_ids)} tokens; the compiled prefill takes 1 to {self.max_prompt_tokens}")
        padded = torch.full((1, self.bucket), self.runner.pad_token_id, dtype=torch.long)
        padded[0, :len(prompt_ids)] = torch.tensor(list(prompt_ids))
        # Padding slots are rewritten by later decode steps before any query can see them.
        logits = self._run(padded, 0, len(prompt_ids) - 1, prefill=True)
        self._position = len(prompt_ids)  # where the first generated token goes
        return logits.float().reshape(-1)

    @torch.inference_mode()
    def decode(self, token_id: int) -> torch.Tensor:
        assert self._position is not None, "decode() before prefill()"
        logits = self._run(torch.tensor([[int(token_id)]]), self._position, 0, prefill=False)
        self._position += 1
        return logits.float().reshape(-1)


class DeployRuntime(_Stepped):
    """The slim deploy's ``export.StepRunner``: the host embedding, then a compiled prefill or decode step."""

    def __init__(self, runner, tokenizer, eos_token_ids=None, max_context: int | None = None):
        super().__init__(runner, tokenizer, _context_limit(max_context, runner.shapes.max_cache_len),
                         runner.shapes.prefill_len, eos_token_ids)

    def _run(self, ids: torch.Tensor, start: int, last_index: int, prefill: bool) -> torch.Tensor:
        runner = self.runner
        if prefill:
            self._kv = export.new_kv_cache(runner.kv_shapes, runner.dtype)
        elif start >= runner.shapes.max_cache_len:
            raise ValueError(f"the KV cache of {runner.shapes.max_cache_len} positions is full")
        step = runner.prefill if prefill else runner.decode
        return step(runner.weights, self._kv, runner.embed(ids), torch.tensor([start]), torch.tensor([last_index]))


class NeuronDeployRuntime(_Stepped):
    """The port's ``neuron.deploy.NeuronStepRunner`` (its KV cache is device state); NOT RUN HERE on an inf2,
    the tests drive it over the cpu variant of the traced module (``neuron.deploy.CpuStateGraph``)."""

    def __init__(self, runner, tokenizer, eos_token_ids=None, max_context: int | None = None):
        super().__init__(runner, tokenizer, _context_limit(max_context, runner.max_len), runner.bucket, eos_token_ids)

    def _run(self, ids: torch.Tensor, start: int, last_index: int, prefill: bool) -> torch.Tensor:
        runner, positions = self.runner, list(range(self.bucket)) if prefill else [start]
        inputs = step_inputs(runner.embed(ids), positions, runner.max_len, runner.config.sliding_window, last_index)
        return host_logits(runner.graph(*inputs), runner.config)


def load_runtime(target: str = "cpu", model_id: str | None = None, *, max_context: int | None = None,
                 runtime: str = "auto", artifact: str | None = None, dtype: torch.dtype = torch.float32):
    """Load ``model_id`` for ``target``: ``"deploy"`` serves the slim deploy of a compiled ``artifact`` folder
    (notebook 04 writes ``artifacts/04_tiny``), ``"transformers"`` the model as transformers loads it; ``"auto"``
    is deploy when an artifact is given on cpu, else transformers. Neuron serves its NxD ``artifact``."""
    check_target(target)
    model_id = model_id or BUNDLED_ID
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
    if target == "neuron":
        if runtime == "transformers" or artifact is None:
            raise ValueError("the neuron target serves the compiled NxD artifact: pass --artifact <folder> written by "
                             "gemma_nb.neuron.build.compile_neuron (notebook 04); it holds the tokenizer and config too")
        return load_neuron_runtime(artifact, max_context)
    if runtime == "transformers" or (runtime == "auto" and (target != "cpu" or artifact is None)):
        model, tokenizer = load_model(model_id, dtype=dtype, device=torch_device(target))
        return TransformersRuntime(model, tokenizer, max_context)
    if target != "cpu" or artifact is None:
        raise ValueError("runtime 'deploy' serves gemma_nb.export's cpu artifact: pass --artifact <folder> (notebook 04 "
                         f"compiles the bundled checkpoint into outputs/cpu/artifacts/04_tiny), on cpu (target {target!r})")
    return DeployRuntime(slim_runner(artifact), *_tokenizer_and_eos(model_id), max_context=max_context)


def load_neuron_runtime(artifact: str, max_context: int | None = None) -> NeuronDeployRuntime:
    """The port's slim deploy on Inferentia2 (NOT RUN HERE): everything, tokenizer included, from the artifact."""
    runner, figures = slim_deploy(artifact)
    log.info("NEFF loaded in %.1f s; host embedding in %.1f s", figures["neff_load_s"], figures["embedding_load_s"])
    return NeuronDeployRuntime(runner, *_tokenizer_and_eos(artifact), max_context=max_context)


def slim_runner(folder: str) -> export.StepRunner:
    """An artifact's programs and mmapped weights, the embedding table on the host with the scale of the
    model's own embedding module (rebuilt on the meta device, where the buffer has no value)."""
    artifact = export.load_artifact(folder)
    module = model_skeleton(artifact.config()).get_input_embeddings()
    return artifact.runner(HostEmbedding.from_file(export.host_embedding_path(folder), shape=tuple(module.weight.shape),
                                                   scale=torch.tensor(module.scalar_embed_scale)))


def _tokenizer_and_eos(model_id: str):
    from transformers import AutoTokenizer, GenerationConfig

    source = resolve_model_id(model_id)
    token = None if os.path.isdir(source) else hf_token()
    tokenizer = AutoTokenizer.from_pretrained(source, token=token, trust_remote_code=False)
    try:  # Gemma's chat models also end a turn with <end_of_turn>, listed in generation_config.json
        return tokenizer, GenerationConfig.from_pretrained(source, token=token).eos_token_id
    except OSError:
        return tokenizer, None
