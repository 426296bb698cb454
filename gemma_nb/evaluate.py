"""How answers are scored (notebooks 02, 05, 06): greedy decoding, fact recall, logit agreement,
token match. A model is a causal LM (decoded with its KV cache) or a callable ``input_ids [B, S] ->
logits [B, S, V]`` (re-run each step)."""

import math
from collections.abc import Callable, Iterable, Sequence

import pandas as pd
import torch

from gemma_nb.tiny import FACTS

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
Model = torch.nn.Module | LogitsFn


def _is_hf_model(model) -> bool:
    return (
        isinstance(model, torch.nn.Module)
        and hasattr(model, "config")
        and hasattr(model, "get_input_embeddings")
    )


def as_logits_fn(model: Model) -> LogitsFn:
    """``model`` as a function ``input_ids [B, S] -> logits [B, S, V]`` (no KV cache)."""
    if _is_hf_model(model):
        return lambda input_ids: model(input_ids=input_ids, use_cache=False).logits
    assert callable(model), f"model {type(model).__name__} is neither a causal LM nor a logits_fn"

    def call(input_ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids)
        logits = getattr(out, "logits", out)
        assert (
            isinstance(logits, torch.Tensor)
            and logits.dim() == 3
            and logits.shape[:2] == input_ids.shape
        ), "a logits_fn must return logits [B, S, V] for input_ids [B, S]"
        return logits

    return call


def _as_batch(input_ids) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    ids = ids[None] if ids.dim() == 1 else ids
    assert ids.dim() == 2 and ids.shape[1] > 0, (
        f"input_ids {tuple(ids.shape)}: expected token ids [S] or [B, S]"
    )
    return ids


@torch.inference_mode()
def greedy_generate(
    model: Model, input_ids, max_new_tokens: int, eos_token_id: int | None = None
) -> torch.Tensor:
    """Greedy continuation of unpadded ``input_ids`` [S] or [B, S]: the prompt plus n <=
    ``max_new_tokens`` tokens. A row that emitted ``eos_token_id`` keeps emitting it; decoding stops
    once every row has."""
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 0
    ):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a non-negative integer")
    ids = _as_batch(input_ids).to(_device_of(model))
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    # a causal LM decodes with its KV cache (``past`` once it has run), anything else re-runs on all
    # of ids
    logits_fn, past = (None, {}) if _is_hf_model(model) else (as_logits_fn(model), None)
    for _ in range(max_new_tokens):
        if logits_fn is None:
            out = model(
                input_ids=ids[:, -1:] if past else ids, **past, use_cache=True, logits_to_keep=1
            )
            past, logits = {"cache": out.cache}, out.logits
        else:
            logits = logits_fn(ids)
        next_token = logits[:, -1].float().argmax(dim=-1)
        if eos_token_id is not None:
            next_token = torch.where(done, torch.full_like(next_token, eos_token_id), next_token)
            done |= next_token == eos_token_id
        ids = torch.cat([ids, next_token[:, None]], dim=1)
        if eos_token_id is not None and bool(done.all()):
            break
    return ids


def _device_of(model) -> torch.device:
    model = model.model if isinstance(model, CachedLogits) else model
    parameters = model.parameters() if isinstance(model, torch.nn.Module) else ()
    return next((parameter.device for parameter in parameters), torch.device("cpu"))


def length_batches(token_lists: Sequence[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """``token_lists`` grouped by length, shortest first, unpadded: (the group's indices, its tokens
    [n, S])."""
    lengths = sorted({len(tokens) for tokens in token_lists})
    groups = [[i for i, tokens in enumerate(token_lists) if len(tokens) == n] for n in lengths]
    return [(indices, torch.tensor([token_lists[i] for i in indices])) for indices in groups]


@torch.inference_mode()
def fact_recall(model: Model, tokenizer, facts=None) -> tuple[float, pd.DataFrame]:
    """(accuracy, one row per fact) of greedy recall on ``facts`` (``prompt``, ``answer``; default
    the corpus), token by token."""
    facts = list(FACTS if facts is None else facts)
    assert facts, "facts is empty"
    prompts = [tokenizer(f.prompt).input_ids for f in facts]
    answers = [tokenizer(f.answer, add_special_tokens=False).input_ids for f in facts]
    generated: list[list[int]] = [[] for _ in facts]
    for indices, batch in length_batches(prompts):
        steps = max(len(answers[i]) for i in indices)
        out = greedy_generate(model, batch, steps)[:, batch.shape[1] :].tolist()
        for row, i in zip(out, indices):
            generated[i] = row[: len(answers[i])]
    table = pd.DataFrame(
        [
            {
                "kind": getattr(f, "kind", ""),
                "subject": getattr(f, "subject", ""),
                "prompt": f.prompt,
                "expected": f.answer,
                "generated": tokenizer.decode(g),
                "correct": g == a,
            }
            for f, g, a in zip(facts, generated, answers)
        ]
    )
    return float(table["correct"].mean()), table


class CachedLogits:
    """``model(input_ids).logits`` computed once per distinct batch: a reference scored against
    several candidates."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache: dict = {}

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        key = (tuple(input_ids.shape), input_ids.cpu().numpy().tobytes())
        if key not in self.cache:
            self.cache[key] = self.model(
                input_ids=input_ids.to(_device_of(self.model)), use_cache=False
            ).logits
        return self.cache[key]


def prompt_batches(tokenizer, texts: Iterable[str] | None = None) -> list[torch.Tensor]:
    """``texts`` (default: every corpus sentence) tokenized and batched by length, no padding."""
    token_lists = [
        tokenizer(t).input_ids for t in ([f.sentence for f in FACTS] if texts is None else texts)
    ]
    return [batch for _, batch in length_batches(token_lists)]


def text_batches(tokenizer, text: str, chunk_tokens: int, max_tokens: int) -> list[torch.Tensor]:
    """``text`` tokenized as one stream and cut into sequences ``[1, chunk_tokens]``, each opening
    with <bos> (llama.cpp's perplexity chunks), at most ``max_tokens`` tokens in all."""
    ids, step = tokenizer(text, add_special_tokens=False).input_ids, chunk_tokens - 1
    starts = range(0, len(ids) - step + 1, step)[: max_tokens // chunk_tokens]
    if not starts:
        raise ValueError(
            f"the text has {len(ids)} tokens, fewer than one sequence of chunk_tokens="
            f"{chunk_tokens}: pass a longer text or a smaller chunk_tokens"
        )
    return [torch.tensor([[tokenizer.bos_token_id, *ids[i : i + step]]]) for i in starts]


@torch.inference_mode()
def next_token_logprobs(model: Model, input_ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log-probabilities ``[B, S - 1, V]`` (fp32, cpu) of the tokens after each
    position of ``input_ids [B, S]`` but the last."""
    logits = as_logits_fn(model)(input_ids.to(_device_of(model)))[:, :-1]
    return logits.float().log_softmax(-1).cpu()


def position_scores(reference_logp, candidate_logp, targets=None) -> dict[str, torch.Tensor]:
    """Per position of log-probabilities ``[..., V]``: ``kld`` KL(reference || candidate) in nats,
    ``top1`` (same argmax) and, with ``targets``, the candidate's ``nll`` of them."""
    scores = {
        "kld": (reference_logp.exp() * (reference_logp - candidate_logp)).sum(-1).flatten(),
        "top1": (reference_logp.argmax(-1) == candidate_logp.argmax(-1)).flatten(),
    }
    if targets is not None:
        scores["nll"] = -candidate_logp.gather(-1, targets[..., None]).flatten()
    return scores


def shift_summary(per_batch: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """:func:`position_scores` of all batches as llama.cpp's ``--kl-divergence`` reports them:
    ``kld_mean``, ``kld_p99`` (nats), ``top1_agreement``, the candidate's ``perplexity``."""
    scores = {key: torch.cat([batch[key] for batch in per_batch]) for key in per_batch[0]}
    kld = scores["kld"].double()
    return {
        "kld_mean": float(kld.mean()),
        "kld_p99": float(torch.quantile(kld, 0.99)),
        "top1_agreement": float(scores["top1"].double().mean()),
        "perplexity": math.exp(float(scores["nll"].double().mean())),
    }


@torch.inference_mode()
def compare_logits(reference: Model, candidate: Model, input_ids_batches, tokenizer=None) -> dict:
    """``candidate``'s next-token logits against ``reference``'s at every position of
    ``input_ids_batches`` (a LongTensor [B, S], a list of them, or strings with ``tokenizer``):
    top1_agreement, kl_mean (KL(ref || cand), nats), max_abs_diff, positions."""
    items = (
        [input_ids_batches]
        if isinstance(input_ids_batches, torch.Tensor)
        else list(input_ids_batches)
    )
    assert items, "input_ids_batches is empty"
    strings = all(isinstance(item, str) for item in items)
    assert tokenizer is not None or not strings, "input_ids_batches holds strings: pass tokenizer="
    batches = prompt_batches(tokenizer, items) if strings else [_as_batch(item) for item in items]
    ref_fn, cand_fn = as_logits_fn(reference), as_logits_fn(candidate)
    agree, kl_sum, max_abs, positions = 0, 0.0, 0.0, 0
    for ids in batches:
        ref = ref_fn(ids.to(_device_of(reference))).float().cpu()
        cand = cand_fn(ids.to(_device_of(candidate))).float().cpu()
        assert ref.shape == cand.shape, (
            f"reference logits {tuple(ref.shape)}, candidate {tuple(cand.shape)}"
        )
        scores = position_scores(ref.log_softmax(-1), cand.log_softmax(-1))
        agree += int(scores["top1"].sum())
        kl_sum += float(scores["kld"].sum())
        max_abs = max(max_abs, float((ref - cand).abs().max()))
        positions += ids.numel()
    return {
        "top1_agreement": agree / positions,
        "kl_mean": kl_sum / positions,
        "max_abs_diff": max_abs,
        "positions": positions,
    }


@torch.inference_mode()
def greedy_match(
    reference: Model, candidate: Model, input_ids, steps: int = 32, tokenizer=None
) -> dict:
    """Greedy-decode exactly ``steps`` tokens with both models from one prompt and compare token for
    token. Returns ``match``, ``first_divergent_step`` (or None), both token lists, and their texts
    with ``tokenizer``."""
    ids = _as_batch(input_ids)
    assert ids.shape[0] == 1, (
        f"input_ids has batch size {ids.shape[0]}; greedy_match compares one sequence"
    )
    ref_tokens, cand_tokens = (
        greedy_generate(model, ids, steps)[0, ids.shape[1] :].tolist()
        for model in (reference, candidate)
    )
    first = next((i for i, (r, c) in enumerate(zip(ref_tokens, cand_tokens)) if r != c), None)
    result = {
        "match": first is None,
        "first_divergent_step": first,
        "reference_tokens": ref_tokens,
        "candidate_tokens": cand_tokens,
    }
    if tokenizer is not None:
        result.update(
            reference_text=tokenizer.decode(ref_tokens),
            candidate_text=tokenizer.decode(cand_tokens),
        )
    return result
