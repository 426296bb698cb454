"""The model behind the server, a ``Runtime`` (slim deploy, transformers, the port's NxD deploy),
and ``Generation``: one request over it, a token per ``step()`` so the server can stream, time and
stop between tokens."""

import logging
import math
import os
from collections import namedtuple
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from jinja2 import TemplateError
from transformers import AutoTokenizer, DynamicCache, GenerationConfig

from gemma_nb import export
from gemma_nb.cli import RUNTIMES
from gemma_nb.embedding import HostEmbedding
from gemma_nb.modelio import hf_token, load_model, model_skeleton, resolve_model_id
from gemma_nb.neuron.deploy import slim_deploy
from gemma_nb.targets import check_target, torch_device
from gemma_nb.tiny import BUNDLED_ID

# Prompt tokens decoded together with the answer so a word keeps its leading space (" Paris").
DETOKENIZE_CONTEXT_TOKENS = 4
log = logging.getLogger("gemma_nb.serve")


class Runtime:
    """One sequence at a time: ``prefill(prompt_ids)`` starts it, ``decode(token_id)`` adds a token,
    each returning the next logits [vocab]; ``max_context`` counts prompt and answer, a fixed
    prefill bucket also sets ``max_prompt_tokens``."""

    def __init__(self, tokenizer, max_context: int, eos_token_ids=None):
        self.tokenizer, self.max_context = tokenizer, max_context
        sources = [eos_token_ids, tokenizer.eos_token_id]
        self.eos_token_ids = frozenset(
            i for s in sources if s is not None for i in ([s] if isinstance(s, int) else s)
        )


def message_texts(messages: Sequence[dict]) -> list[str]:
    """Each message's text: its content, or its text parts joined."""
    return [
        m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])
        for m in messages
    ]


def chat_prompt_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """A chat's token ids: its chat template, or (a tokenizer without one) the contents joined by
    newlines."""
    texts = message_texts(messages)
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer("\n".join(t for t in texts if t))["input_ids"])
    try:
        text = tokenizer.apply_chat_template(
            [{"role": m["role"], "content": t} for m, t in zip(messages, texts)],
            tokenize=False,
            add_generation_prompt=True,
        )
    except TemplateError as error:  # e.g. roles that do not alternate: the client's to fix
        raise ValueError(f"the model's chat template refuses these messages: {error}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class SamplingParams(NamedTuple):
    """How to pick each token: ``temperature == 0`` is greedy, ``top_k <= 0`` no top-k."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> int:
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    # float64, the best score shifted to 0 first: a tiny temperature sends the rest to -inf, not all
    # to inf (NaN)
    scores = logits.double()
    scores = (scores - scores.max()) / params.temperature
    if 0 < params.top_k < scores.numel():
        scores = scores.masked_fill(scores < torch.topk(scores, params.top_k).values[-1], -math.inf)
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token once the ones before it already cover top_p; the first always stays.
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, -math.inf))
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))


# One generated token: its id, the new text it made visible, and why generation ended ("stop",
# "length"; None).
Step = namedtuple("Step", "token_id text finish_reason")


@dataclass
class Generation:
    """One request's decoding, a token per ``step()``; text that might start a stop string, or ends
    in half a character, is held back (a stop string is never streamed)."""

    runtime: Runtime
    prompt_ids: list[int]
    params: SamplingParams
    strip_leading_space: bool = False
    token_ids: list[int] = field(default_factory=list, init=False)
    finish_reason: str | None = field(default=None, init=False)
    _emitted: int = field(default=0, init=False, repr=False)

    def __post_init__(self):
        self._context = self.prompt_ids[-DETOKENIZE_CONTEXT_TOKENS:]
        self._context_text = self.runtime.tokenizer.decode(self._context, skip_special_tokens=True)
        seed = int.from_bytes(os.urandom(8)) if self.params.seed is None else self.params.seed
        self._generator = torch.Generator().manual_seed(seed)

    @property
    def text(self) -> str:
        """The answer so far as the client sees it (stop strings and after removed)."""
        return self._visible()[0]

    def _visible(self) -> tuple[str, bool]:
        full = self.runtime.tokenizer.decode(
            self._context + self.token_ids, skip_special_tokens=True
        )
        # A tokenizer that merges across the boundary keeps only the common prefix's tail.
        text = full[len(os.path.commonprefix([full, self._context_text])) :]
        text = text.lstrip() if self.strip_leading_space else text
        cut = min((i for i in (text.find(s) for s in self.params.stop) if i >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)

    def step(self) -> Step:
        assert self.finish_reason is None, "generation already finished"
        logits = (
            self.runtime.decode(self.token_ids[-1])
            if self.token_ids
            else self.runtime.prefill(self.prompt_ids)
        )
        token = sample_token(logits, self.params, self._generator)
        self.token_ids.append(token)
        text, stopped = self._visible()
        if stopped or (token in self.runtime.eos_token_ids and not self.params.ignore_eos):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is None:
            text = text[: len(text) - held_back(text, self.params.stop)]
        delta = text[self._emitted :]
        self._emitted = max(self._emitted, len(text))
        return Step(token, delta, self.finish_reason)

    def __iter__(self) -> Iterator[Step]:
        while self.finish_reason is None:
            yield self.step()

    def usage(self) -> dict:
        return {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.token_ids),
            "total_tokens": len(self.prompt_ids) + len(self.token_ids),
        }


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters to keep unsent: a possible stop-string start or a partial
    character."""
    starts = (
        next((n for n in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:n])), 0)
        for stop in stops
    )
    return max(int(text.endswith("\ufffd")), 0, *starts)


def generate(
    runtime: Runtime, prompt: str | Sequence[int], max_tokens: int = 32, **sampling
) -> Generation:
    """One generation run to the end (``generate(runtime, "The capital of France is", 4).text``: ``"
    Paris ."``)."""
    ids = list(runtime.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
    generation = Generation(runtime, ids, SamplingParams(max_tokens=max_tokens, **sampling))
    for _ in generation:
        pass
    return generation


def _context_limit(requested: int | None, model_limit: int | None) -> int:
    if requested is None and model_limit is None:
        raise ValueError(
            "the model does not say how long its context is: pass max_context (--max-context N)"
        )
    if requested is not None and not 2 <= requested <= (model_limit or requested):
        raise ValueError(
            f"max_context={requested}: a prompt and one new token need at least 2, and the model "
            f"holds {model_limit} positions; pass --max-context between 2 and {model_limit}"
        )
    return int(model_limit if requested is None else requested)


class TransformersRuntime(Runtime):
    """A transformers causal LM (``model(input_ids, cache=...)``) with its own KV cache."""

    def __init__(self, model, tokenizer, max_context: int | None = None):
        limit = getattr(model.config, "max_position_embeddings", None) or max_context
        super().__init__(
            tokenizer,
            _context_limit(max_context, limit),
            getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        )
        self.model, self._device, self._cache = model, next(model.parameters()).device, None

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> torch.Tensor:
        input_ids = torch.tensor([ids], dtype=torch.long, device=self._device)
        return (
            self.model(input_ids=input_ids, cache=self._cache, use_cache=True, logits_to_keep=1)
            .logits[0, -1]
            .float()
            .cpu()
        )

    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        self._cache = DynamicCache(config=self.model.config)
        return self._forward(list(prompt_ids))

    def decode(self, token_id: int) -> torch.Tensor:
        assert self._cache is not None, "decode() before prefill()"
        return self._forward([token_id])


class _Stepped(Runtime):
    """A compiled deploy, one token a step: the prompt padded to the fixed prefill ``bucket``, then
    a decode step each."""

    def __init__(self, runner, tokenizer, context: int, bucket: int, eos_token_ids=None):
        super().__init__(tokenizer, context, eos_token_ids)
        self.runner, self.bucket, self._position = runner, bucket, None
        self.max_prompt_tokens = min(bucket, context - 1)

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        if not 0 < len(prompt_ids) <= self.max_prompt_tokens:
            raise ValueError(
                f"a prompt of {len(prompt_ids)} tokens; the compiled prefill takes 1 to "
                f"{self.max_prompt_tokens}"
            )
        padded = torch.full((1, self.bucket), self.runner.pad_token_id, dtype=torch.long)
        padded[0, : len(prompt_ids)] = torch.tensor(list(prompt_ids))
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
    """The slim deploy's ``export.StepRunner``: the host embedding, then a compiled prefill or
    decode step."""

    def __init__(self, runner, tokenizer, eos_token_ids=None, max_context: int | None = None):
        super().__init__(
            runner,
            tokenizer,
            _context_limit(max_context, runner.shapes.max_cache_len),
            runner.shapes.prefill_len,
            eos_token_ids,
        )

    def _run(self, ids: torch.Tensor, start: int, last_index: int, prefill: bool) -> torch.Tensor:
        runner = self.runner
        if prefill:
            self._kv = export.new_kv_cache(runner.kv_shapes, runner.dtype)
        elif start >= runner.shapes.max_cache_len:
            raise ValueError(f"the KV cache of {runner.shapes.max_cache_len} positions is full")
        step = runner.prefill if prefill else runner.decode
        return step(
            runner.weights,
            self._kv,
            runner.embed(ids),
            torch.tensor([start]),
            torch.tensor([last_index]),
        )


class NeuronDeployRuntime(_Stepped):
    """The port's ``neuron.deploy.NeuronStepRunner`` (KV cache in device state); tested over
    ``CpuStateGraph``."""

    def __init__(self, runner, tokenizer, eos_token_ids=None, max_context: int | None = None):
        super().__init__(
            runner,
            tokenizer,
            _context_limit(max_context, runner.max_len),
            runner.bucket,
            eos_token_ids,
        )

    def _run(self, ids: torch.Tensor, start: int, last_index: int, prefill: bool) -> torch.Tensor:
        return self.runner.step(ids, list(range(self.bucket)) if prefill else [start], last_index)


def load_runtime(
    target: str = "cpu",
    model_id: str = BUNDLED_ID,
    *,
    max_context: int | None = None,
    runtime: str = "auto",
    artifact: str | None = None,
    dtype: torch.dtype = torch.float32,
):
    """``model_id`` for ``target``: ``"deploy"`` the slim deploy of a compiled ``artifact``,
    ``"transformers"`` the model as transformers loads it, ``"auto"`` deploy with an artifact on
    cpu; neuron serves its NxD ``artifact``."""
    check_target(target)
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
    if target == "neuron":
        if runtime == "transformers" or artifact is None:
            raise ValueError(
                "the neuron target serves the compiled NxD artifact: pass --artifact <folder> "
                "written by gemma_nb.neuron.build.compile_neuron (notebook 04); it holds the "
                "tokenizer and config too"
            )
        runner, figures = slim_deploy(artifact)  # NOT RUN HERE on an inf2
        log.info(
            "NEFF loaded in %.1f s; host embedding in %.1f s",
            figures["neff_load_s"],
            figures["embedding_load_s"],
        )
        return NeuronDeployRuntime(runner, *_tokenizer_and_eos(artifact), max_context=max_context)
    if runtime == "transformers" or (runtime == "auto" and (target != "cpu" or artifact is None)):
        return TransformersRuntime(
            *load_model(model_id, dtype=dtype, device=torch_device(target)), max_context
        )
    if target != "cpu" or artifact is None:
        raise ValueError(
            "runtime 'deploy' serves gemma_nb.export's cpu artifact: pass --artifact <folder> "
            "(notebook 04 compiles the bundled checkpoint into outputs/cpu/artifacts/04_tiny), "
            f"on cpu (target {target!r})"
        )
    # The artifact's programs and mmapped weights, the embedding on the host with the scale of the
    # model's own (rebuilt on the meta device, where the buffer has no value).
    exported = export.load_artifact(artifact)
    module = model_skeleton(exported.config()).get_input_embeddings()
    runner = exported.runner(
        HostEmbedding.from_file(
            export.host_embedding_path(artifact),
            shape=tuple(module.weight.shape),
            scale=torch.tensor(module.scalar_embed_scale),
        )
    )
    return DeployRuntime(runner, *_tokenizer_and_eos(model_id), max_context=max_context)


def _tokenizer_and_eos(model_id: str):
    source = resolve_model_id(model_id)
    token = None if os.path.isdir(source) else hf_token()
    tokenizer = AutoTokenizer.from_pretrained(source, token=token, trust_remote_code=False)
    try:  # Gemma's chat models also end a turn with <end_of_turn>, listed in generation_config.json
        return tokenizer, GenerationConfig.from_pretrained(source, token=token).eos_token_id
    except OSError:
        return tokenizer, None
