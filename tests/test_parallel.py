"""The vocab-parallel int8 lm_head and the gloo launcher (gemma_nb.experiments.lm_head_sharding),
and the NxD head's checkpoint.

The 2-rank jobs really start two processes with torch.distributed gloo on 127.0.0.1. spawn imports
a worker's module by name in each rank: the head's worker lives at the top of this module, the
failing ones in tests/failing_ranks.py, which imports torch alone.
"""

from __future__ import annotations

import importlib.util
import time
from types import SimpleNamespace

import pytest
import torch
from failing_ranks import dying_job, raising_job, stuck_job

from gemma_nb.experiments.lm_head_sharding import (
    VocabParallelLMHead,
    lm_head_job,
    logits_agreement,
    seeded_rows,
    softcap_logits,
    vocab_shard,
)
from gemma_nb.formats import quantize_int8_per_channel
from gemma_nb.quant import Int8Linear
from gemma_nb.ranks import TPJobError, run_tp

HIDDEN = 64
# Job wall-clock bounds: generous for a loaded 2-core box, far below "hangs forever".
JOB_BOUND_S = 120  # generous: two ranks import torch on a loaded 2-core box


# --- workers (run inside the spawned ranks) -----------------------------------------------------


def head_of(weight: torch.Tensor, tp: int, rank: int) -> VocabParallelLMHead:
    return VocabParallelLMHead.from_rows(lambda a, b: weight[a:b], *weight.shape, tp=tp, rank=rank)


def heads_job(rank: int, world_size: int, cases: list) -> dict:
    """lm_head_job for each (weight, hidden) case, plus the rank-local logits
    (gather_output=False)."""
    out = []
    for weight, hidden in cases:
        result = lm_head_job(rank, world_size, weight, hidden)
        head = head_of(weight, tp=world_size, rank=rank)
        result["local_logits"] = head.local_logits(hidden)
        out.append(result)
    return {"cases": out}


# --- sharding arithmetic ----------------------------------------------------------------------


def test_full_size_shards_split_the_vocab_in_half_without_padding():
    shards = [vocab_shard(262144, 2, r) for r in range(2)]
    assert [(s.start, s.stop, s.pad_rows) for s in shards] == [(0, 131072, 0), (131072, 262144, 0)]


@pytest.mark.parametrize("vocab_size,tp", [(1001, 2), (1000, 3), (64, 4), (5, 2)])
def test_shards_cover_every_row_once_and_start_aligned(vocab_size, tp):
    shards = [vocab_shard(vocab_size, tp, r) for r in range(tp)]
    rows = [i for s in shards for i in range(s.start, s.stop)]
    assert rows == list(range(vocab_size))
    assert all(s.rows_per_rank == shards[0].rows_per_rank for s in shards)
    assert all(s.rank * s.rows_per_rank % 64 == 0 for s in shards)
    assert sum(s.pad_rows for s in shards) == shards[0].rows_per_rank * tp - vocab_size


def test_bad_shard_arguments_name_the_value():
    with pytest.raises(ValueError, match="tp=0"):
        vocab_shard(1000, 0, 0)


def test_seeded_rows_are_the_same_however_they_are_requested():
    whole = seeded_rows(3, 0, 9000, 8)
    assert torch.equal(seeded_rows(3, 4000, 8500, 8), whole[4000:8500])
    assert torch.equal(torch.cat([seeded_rows(3, 0, 17, 8), seeded_rows(3, 17, 9000, 8)]), whole)
    assert not torch.equal(seeded_rows(4, 0, 9000, 8), whole)


# --- the head in one process --------------------------------------------------------------------


def test_single_rank_head_is_the_int8_linear_head():
    torch.manual_seed(0)
    weight, hidden = torch.randn(300, HIDDEN), torch.randn(5, HIDDEN)
    head = head_of(weight, tp=1, rank=0)
    reference = Int8Linear.from_weight(weight)
    assert torch.equal(head.qweight[:300], reference.qweight) and torch.equal(
        head.scale[:300], reference.scale
    )
    assert torch.equal(head(hidden), reference(hidden.bfloat16()))
    assert head.nbytes == head.shard.rows_per_rank * (HIDDEN + 4)


def test_sharded_head_outside_a_process_group_is_a_clear_error():
    with pytest.raises(ValueError, match="needs torch.distributed initialised.*run_tp"):
        head_of(torch.randn(128, HIDDEN), tp=2, rank=0)


def test_softcap_matches_the_model_and_validates_the_cap():
    from gemma_nb.experiments.lm_head_sharding import head_inputs
    from gemma_nb.tiny import random_gemma4_config, random_gemma4_model

    config = random_gemma4_config(num_hidden_layers=1, vocab_size=300)
    model = random_gemma4_model(config, seed=0, dtype=torch.float32).eval()
    hidden, model_logits = head_inputs(model, [torch.tensor([[2, 17, 40, 299]])])
    raw = torch.nn.functional.linear(hidden, model.lm_head.weight)
    assert config.final_logit_softcapping == 30.0
    assert torch.equal(softcap_logits(raw, config.final_logit_softcapping), model_logits)
    assert torch.equal(softcap_logits(raw, None), raw)
    with pytest.raises(ValueError, match="softcap -1"):
        softcap_logits(raw, -1)


# --- two real gloo ranks ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_rank_cases():
    torch.manual_seed(0)
    # not divisible: padded and masked
    cases = [
        (torch.randn(1024, HIDDEN), torch.randn(6, HIDDEN)),  # divisible by tp=2
        (torch.randn(1001, HIDDEN), torch.randn(2, 3, HIDDEN)),
    ]
    results = run_tp(heads_job, (cases,), world_size=2, timeout_s=JOB_BOUND_S)
    return cases, results


def test_two_ranks_gather_exactly_the_unsharded_int8_logits(two_rank_cases):
    cases, results = two_rank_cases
    for i, (weight, hidden) in enumerate(cases):
        unsharded = Int8Linear.from_weight(weight)(hidden.bfloat16())
        for rank_result in results:
            got = rank_result["cases"][i]
            assert got["logits"].shape == unsharded.shape
            agreement = logits_agreement(unsharded, got["logits"])
            assert agreement["bit_exact"] and agreement["argmax_identical"], (
                i,
                got["rank"],
                agreement,
            )


def test_vocab_not_divisible_is_padded_and_masked(two_rank_cases):
    cases, results = two_rank_cases
    rank0, rank1 = (r["cases"][1] for r in results)
    assert (rank0["start"], rank0["stop"], rank0["pad_rows"]) == (0, 512, 0)
    assert (rank1["start"], rank1["stop"], rank1["pad_rows"]) == (512, 1001, 23)
    assert rank0["shard_bytes"] == rank1["shard_bytes"] == 512 * (HIDDEN + 4)
    local = rank1["local_logits"]
    assert local.shape == (2, 3, 512)
    assert torch.isneginf(local[..., 489:]).all() and torch.isfinite(local[..., :489]).all()
    assert rank1["logits"].shape[-1] == 1001


def test_a_bad_world_size_is_refused_before_launch():
    start = time.monotonic()
    with pytest.raises(ValueError, match="world_size=0"):
        run_tp(heads_job, ([],), world_size=0)
    assert time.monotonic() - start < 1.0


def test_worker_defined_in_a_notebook_is_refused():
    def notebook_worker(rank, world_size):
        return {}

    with pytest.raises(ValueError, match="top-level function"):
        run_tp(notebook_worker)
    notebook_worker.__module__, notebook_worker.__qualname__ = "__main__", "notebook_worker"
    with pytest.raises(ValueError, match="__main__"):
        run_tp(notebook_worker)


def _failure(job, failure_grace_s: float = 5.0, **kwargs) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(TPJobError) as info:
        run_tp(job, world_size=2, timeout_s=JOB_BOUND_S, failure_grace_s=failure_grace_s, **kwargs)
    return str(info.value), time.monotonic() - start


def test_a_rank_that_raises_fails_the_job_naming_it():
    message, seconds = _failure(raising_job, collective_timeout_s=10)
    assert "rank 1: RuntimeError" in message
    assert "rank 0 (waiting" in message
    assert seconds < JOB_BOUND_S


def test_a_rank_that_dies_fails_the_job_naming_it():
    # Rank 0 is not checked here: the grace after the death need not outlast its collective.
    message, seconds = _failure(dying_job, failure_grace_s=1.0, collective_timeout_s=10)
    assert "rank 1: exited" in message and "code 7" in message
    assert seconds < JOB_BOUND_S


def test_a_stuck_rank_makes_the_collective_time_out_instead_of_hanging():
    # Rank 1 never reports: the grace after rank 0's timeout is all the wait it gets.
    message, seconds = _failure(stuck_job, failure_grace_s=1.0, collective_timeout_s=2)
    assert "rank 0 (waiting" in message and "Timed out" in message
    assert "rank 1 was" in message and "stopped" in message
    assert seconds < JOB_BOUND_S


# --- the NxD head's checkpoint (pure torch; the SDK is not installed here) ------------------------


def test_nxd_head_checkpoint_is_made_from_the_embedding_and_sdk_is_import_guarded():
    from gemma_nb.neuron import lm_head
    from gemma_nb.targets import TargetError

    embed = torch.randn(10, HIDDEN)
    state = lm_head.untie_lm_head({"model.embed_tokens.weight": embed, "lm_head.weight": embed})
    q, scale = quantize_int8_per_channel(embed)
    assert torch.equal(state["lm_head.weight"], q) and torch.equal(state["lm_head.scale"], scale)
    assert state["lm_head.weight"].dtype == torch.int8 and state["lm_head.scale"].shape == (10, 1)
    enums = SimpleNamespace(INT8="int8", PER_CHANNEL_SYMMETRIC="per_channel")
    kwargs = lm_head.build_lm_head(
        2816,
        262144,
        sdk=SimpleNamespace(
            QuantizedColumnParallel=dict, QuantizedDtype=enums, QuantizationType=enums
        ),
    )
    assert (
        kwargs["gather_output"] is True
        and kwargs["bias"] is False
        and kwargs["quantization_per_channel_axis"] == 0
    )
    if importlib.util.find_spec("neuronx_distributed") is None:  # everywhere but a Neuron instance
        with pytest.raises(TargetError, match="neuronx_distributed"):
            lm_head.build_lm_head(HIDDEN, 10)
    assert torch.equal(lm_head.trim_padded_logits(torch.zeros(2, 12), 10), torch.zeros(2, 10))
