"""gemma_nb.evaluate: greedy decoding, fact recall, logit comparison, greedy token match."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from gemma_nb.evaluate import (
    as_logits_fn,
    compare_logits,
    fact_recall,
    greedy_generate,
    greedy_match,
)
from gemma_nb.tiny import random_gemma4_config, random_gemma4_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    config = random_gemma4_config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        head_dim=16,
        global_head_dim=32,
        moe_intermediate_size=32,
    )
    return random_gemma4_model(config, seed=3, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompt():
    return torch.tensor([[2, 10, 11, 12, 13]])


def test_cached_decode_equals_recomputed_decode(model, prompt):
    cached = greedy_generate(model, prompt, 12)
    recomputed = greedy_generate(as_logits_fn(model), prompt, 12)
    assert cached.shape == (1, 5 + 12)
    assert torch.equal(cached[:, :5], prompt)
    assert torch.equal(cached, recomputed)


def test_greedy_generate_is_argmax_of_full_forward(model, prompt):
    ids = greedy_generate(model, prompt, 1)
    expected = model(input_ids=prompt).logits[0, -1].argmax()
    assert ids[0, -1] == expected


def test_greedy_generate_batch_equals_rows(model):
    batch = torch.tensor([[2, 10, 11], [2, 40, 41]])
    together = greedy_generate(model, batch, 6)
    for row in range(2):
        assert torch.equal(together[row], greedy_generate(model, batch[row], 6)[0])


def test_greedy_generate_stops_at_eos(model, prompt):
    free = greedy_generate(model, prompt, 8)[0, 5:].tolist()
    eos = free[2]  # pretend the third new token is eos
    stopped = greedy_generate(model, prompt, 8, eos_token_id=eos)[0, 5:].tolist()
    assert stopped == free[: free.index(eos) + 1]


def test_greedy_generate_rejects_bad_input(model, prompt):
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        greedy_generate(model, prompt, -1)
    with pytest.raises(AssertionError, match="expected token ids"):
        greedy_generate(model, torch.zeros(1, 2, 3, dtype=torch.long), 1)


def test_compare_logits_identical_is_exact(model, prompt):
    result = compare_logits(model, as_logits_fn(model), [prompt, torch.tensor([[2, 5, 6]])])
    assert result == {"top1_agreement": 1.0, "kl_mean": 0.0, "max_abs_diff": 0.0, "positions": 8}


def test_compare_logits_sees_a_perturbation(model, prompt):
    def noisy(ids):
        logits = model(input_ids=ids).logits
        return logits + 0.5 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))

    result = compare_logits(model, noisy, prompt)
    assert result["kl_mean"] > 0
    assert 0.5 <= result["max_abs_diff"] < 5
    assert result["positions"] == 5


def test_compare_logits_rejects_wrong_shapes(model, prompt):
    with pytest.raises(AssertionError, match=r"logits \[B, S, V\]"):
        compare_logits(model, lambda ids: torch.zeros(3), prompt)
    with pytest.raises(AssertionError, match="tokenizer="):
        compare_logits(model, model, ["a sentence"])


def test_greedy_match_finds_first_divergent_step(model, prompt):
    assert greedy_match(model, model, prompt, steps=10) == {
        "match": True,
        "first_divergent_step": None,
        "reference_tokens": greedy_generate(model, prompt, 10)[0, 5:].tolist(),
        "candidate_tokens": greedy_generate(model, prompt, 10)[0, 5:].tolist(),
    }

    def diverges_at_step_3(ids):
        logits = model(input_ids=ids).logits.clone()
        if ids.shape[1] == prompt.shape[1] + 3:  # choosing new token index 3
            logits[:, -1, 0] = 1e4
        return logits

    result = greedy_match(model, diverges_at_step_3, prompt, steps=10)
    assert result["match"] is False
    assert result["first_divergent_step"] == 3
    assert result["candidate_tokens"][3] == 0
    assert result["reference_tokens"][:3] == result["candidate_tokens"][:3]


def test_greedy_match_wants_one_sequence(model):
    with pytest.raises(AssertionError, match="batch size 2"):
        greedy_match(model, model, torch.tensor([[2, 3], [2, 4]]), steps=2)


def test_fact_recall_on_the_bundled_checkpoint():
    from gemma_nb.modelio import load_model
    from gemma_nb.tiny import FACTS

    tiny, tokenizer = load_model()
    facts = [f for f in FACTS if f.subject in {"France", "Japan", "Brazil"}]
    accuracy, table = fact_recall(tiny, tokenizer, facts)
    assert isinstance(table, pd.DataFrame)
    assert list(table.columns) == ["kind", "subject", "prompt", "expected", "generated", "correct"]
    assert len(table) == len(facts) == 3 + 3 + 3 + 3
    assert accuracy == 1.0
    assert (table["generated"] == table["expected"]).all()
    paris = table[table["prompt"] == "The capital of France is"].iloc[0]
    assert paris["generated"] == "Paris ."


def test_fact_recall_counts_wrong_answers():
    from gemma_nb.modelio import load_model
    from gemma_nb.tiny.corpus import Fact

    tiny, tokenizer = load_model()
    facts = [
        Fact("capital", "France", "The capital of France is", "Paris ."),
        Fact("capital", "France", "The capital of France is", "Berlin ."),
    ]
    accuracy, table = fact_recall(tiny, tokenizer, facts)
    assert accuracy == 0.5
    assert table["correct"].tolist() == [True, False]
    with pytest.raises(AssertionError, match="facts is empty"):
        fact_recall(tiny, tokenizer, [])


def test_teacher_forced_scores_are_llama_cpps_kl_statistics(model, prompt):
    from gemma_nb.evaluate import next_token_logprobs, position_scores, shift_summary

    ids = torch.cat([prompt, prompt.flip(-1)])
    reference = next_token_logprobs(model, ids)
    assert reference.shape == (2, 4, 96) and reference.dtype == torch.float32
    torch.testing.assert_close(
        reference, model(input_ids=ids).logits[:, :-1].float().log_softmax(-1)
    )
    same = shift_summary([position_scores(reference, reference, ids[:, 1:])])
    nll = -reference.gather(-1, ids[:, 1:, None])
    assert (same["kld_mean"], same["kld_p99"], same["top1_agreement"]) == (0.0, 0.0, 1.0)
    assert same["perplexity"] == pytest.approx(float(nll.double().mean().exp()))
    noisy = reference + torch.randn(reference.shape, generator=torch.Generator().manual_seed(0))
    candidate = noisy.log_softmax(-1)
    scores = position_scores(reference, candidate, ids[:, 1:])
    kld = (reference.exp() * (reference - candidate)).sum(-1).flatten()
    torch.testing.assert_close(scores["kld"], kld)
    # two batches summarise as one: the mean over all positions, the 99th percentile of them
    halves = [
        position_scores(reference[i : i + 1], candidate[i : i + 1], ids[i : i + 1, 1:])
        for i in (0, 1)
    ]
    summary = shift_summary(halves)
    assert summary["kld_mean"] == pytest.approx(float(kld.double().mean()))
    assert summary["kld_p99"] == pytest.approx(float(torch.quantile(kld.double(), 0.99)))
    assert summary["top1_agreement"] == float(
        (reference.argmax(-1) == candidate.argmax(-1)).double().mean()
    )


def test_text_batches_cut_a_stream_into_bos_led_sequences():
    from gemma_nb.evaluate import text_batches
    from gemma_nb.tiny.corpus import build_tokenizer

    tokenizer = build_tokenizer()
    text = "The capital of France is Paris . The capital of Italy is Rome ."
    words = tokenizer(text, add_special_tokens=False).input_ids  # 14 words
    batches = text_batches(tokenizer, text, chunk_tokens=5, max_tokens=12)
    assert [b.tolist() for b in batches] == [[[2, *words[:4]]], [[2, *words[4:8]]]]
    assert len(text_batches(tokenizer, text, chunk_tokens=5, max_tokens=100)) == 3  # whole ones
    with pytest.raises(
        ValueError, match="the text has 14 tokens, fewer than one sequence of chunk_tokens=20"
    ):
        text_batches(tokenizer, text, chunk_tokens=20, max_tokens=100)


def test_cached_logits_run_the_reference_once(model, prompt):
    from gemma_nb.evaluate import CachedLogits

    calls = []
    hook = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        cached = CachedLogits(model)
        first = compare_logits(cached, model, [prompt, prompt])
        second = compare_logits(cached, model, prompt)
    finally:
        hook.remove()
    assert first["kl_mean"] == second["kl_mean"] == 0.0 and first["top1_agreement"] == 1.0
    assert len(calls) == 1 + 3  # the reference once; the candidate once per batch
