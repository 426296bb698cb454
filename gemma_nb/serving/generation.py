"""One generation over a loaded model (a ``Runtime``): chat prompts, sampling, stop strings.

``Generation.step()`` makes one token, so the server can stream, time and stop between tokens;
``generate(runtime, prompt, max_tokens)`` runs one to the end (notebook 05 uses it without a server).
A runtime holds one sequence: ``prefill(prompt_ids)`` starts it and returns the logits [vocab] of the
next token, ``decode(token_id)`` appends one and returns the next logits; ``max_context`` counts prompt
and answer, and a fixed prefill bucket also sets ``max_prompt_tokens``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from jinja2 import TemplateError

# Prompt tokens decoded together with the answer so a word keeps its leading space (" Paris").
DETOKENIZE_CONTEXT_TOKENS = 4


class Runtime(Protocol):
    tokenizer: Any
    max_context: int
    eos_token_ids: frozenset[int]

    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor: ...

    def decode(self, token_id: int) -> torch.Tensor: ...


def chat_prompt_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of a chat (``role``, ``content`` a string or text parts): the tokenizer's chat template,
    or, for a tokenizer without one (the bundled word-level one), the contents joined by newlines."""
    texts = [m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"]) for m in messages]
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer("\n".join(t for t in texts if t))["input_ids"])
    try:
        text = tokenizer.apply_chat_template([{"role": m["role"], "content": t} for m, t in zip(messages, texts)],
                                             tokenize=False, add_generation_prompt=True)
    except TemplateError as error:  # e.g. roles that do not alternate: the client's to fix
        raise ValueError(f"the model's chat template refuses these messages: {error}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token. ``temperature == 0`` is greedy; ``top_k <= 0`` means no top-k."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):  # the server's request models check these for clients
        assert self.max_tokens >= 1 and 0 <= self.temperature <= 2 and 0 < self.top_p <= 1, self


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from next-token ``logits`` [vocab] under ``params``."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    # In float64 and shifted so the best score is 0 before dividing: a tiny temperature then sends
    # the others to -inf instead of overflowing all to inf (softmax NaN).
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


@dataclass
class Step:
    """One generated token: its id, the new text it made visible, and why generation ended (if it did)."""
    token_id: int
    text: str
    finish_reason: Literal["stop", "length"] | None = None


@dataclass
class Generation:
    """One request's decoding over a ``Runtime``, a token per ``step()``. Text that might start a stop
    string, or ends in half a character, is held back (a stop string is never streamed)."""

    runtime: Runtime
    prompt_ids: list[int]
    params: SamplingParams
    strip_leading_space: bool = False
    step_delay_s: float = 0.0
    token_ids: list[int] = field(default_factory=list, init=False)
    finish_reason: str | None = field(default=None, init=False)
    _emitted: int = field(default=0, init=False, repr=False)

    def __post_init__(self):
        self._context = self.prompt_ids[-DETOKENIZE_CONTEXT_TOKENS:]
        self._context_text = self.runtime.tokenizer.decode(self._context, skip_special_tokens=True)
        self._generator = torch.Generator()
        if self.params.seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(self.params.seed)

    @property
    def text(self) -> str:
        """The answer so far as the client sees it (stop strings and after removed)."""
        return self._visible(self._decoded())[0]

    def _decoded(self) -> str:
        full = self.runtime.tokenizer.decode(self._context + self.token_ids, skip_special_tokens=True)
        # A tokenizer that merges across the boundary keeps only the common prefix's tail.
        text = full[len(os.path.commonprefix([full, self._context_text])):]
        return text.lstrip() if self.strip_leading_space else text

    def _visible(self, text: str) -> tuple[str, bool]:
        cut = min((i for i in (text.find(s) for s in self.params.stop) if i >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)

    def step(self) -> Step:
        assert self.finish_reason is None, "generation already finished"
        logits = self.runtime.decode(self.token_ids[-1]) if self.token_ids else self.runtime.prefill(self.prompt_ids)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)  # tests and demos: emulate a slower device
        token = sample_token(logits, self.params, self._generator)
        self.token_ids.append(token)
        text, stopped = self._visible(self._decoded())
        if stopped or (token in self.runtime.eos_token_ids and not self.params.ignore_eos):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is None:
            text = text[: len(text) - held_back(text, self.params.stop)]
        delta = text[self._emitted:]
        self._emitted = max(self._emitted, len(text))
        return Step(token, delta, self.finish_reason)

    def __iter__(self) -> Iterator[Step]:
        while self.finish_reason is None:
            yield self.step()


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters to keep unsent: a possible stop-string start or a partial character."""
    hold = 1 if text.endswith("\ufffd") else 0
    for stop in stops:
        hold = max(hold, next((n for n in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:n])), 0))
    return hold


def generate(runtime: Runtime, prompt: str | Sequence[int], max_tokens: int = 32, **sampling) -> Generation:
    """Run one generation to the end: ``generate(runtime, "The capital of France is", 4).text`` is
    ``" Paris ."`` on the bundled checkpoint."""
    ids = list(runtime.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
    generation = Generation(runtime, ids, SamplingParams(max_tokens=max_tokens, **sampling))
    for _ in generation:
        pass
    return generation
