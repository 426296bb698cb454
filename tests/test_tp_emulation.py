"""The neuron build's graphs at TP=2 on two gloo ranks with the NxD stand-ins
(gemma_nb.neuron.emulate)."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gemma_nb.neuron import build as B  # noqa: E402
from gemma_nb.rehearsal import emulate as E  # noqa: E402
from gemma_nb.rehearsal import standins as S  # noqa: E402
from gemma_nb.tiny import random_gemma4_config, random_gemma4_model  # noqa: E402


def test_tp2_greedy_tokens_equal_the_unsharded_int8_model_dense_and_sparse():
    result = E.tp_emulation(
        prompts=("The capital of France is",), new_tokens=6, max_len=16, bucket=8
    )
    assert result["ranks"] == 2 and result["ranks_agree"]
    assert result["tokens_equal_dense"] and result["tokens_equal_sparse"]
    assert result["reference_answers"] == ["Paris ."]
    assert result["kv_heads_unsharded"] == {"sliding_attention": 8, "full_attention": 2}
    assert result["kv_heads_per_rank"] == {"sliding_attention": 4, "full_attention": 1}
    assert result["kv_heads_equal_on_every_rank"] and result["onehot_state_ok"]
    assert result["aliased_state_tensors"] == 12  # K and V of 6 layers
    # per decode mode: one prefill, then 5 decode steps (6 tokens); two modes
    assert result["graph_calls_per_rank"] == {"prefill": 2, "decode": 10}
    assert result["max_abs_logit_diff_dense"] < 1e-3 and result["max_abs_logit_diff_sparse"] < 1e-3
    # bf16 router check: 6 routers x (6 prompt tokens + 5 teacher-forced decode steps)
    assert result["router_choices"] == 6 * (6 + 5) and result["router_ranks_agree"]
    assert (
        0 <= result["router_topk_equal_bf16_autocast_all"] <= result["router_topk_equal_bf16"] <= 1
    )


def test_aliased_graphs_write_the_state_back_and_refuse_a_mismatched_alias():
    model = random_gemma4_model(
        random_gemma4_config(num_hidden_layers=1), seed=0, dtype=torch.float32
    )
    build = B.NeuronBuildConfig(
        model_dir="unused", output_dir="unused", max_len=12, bucket=4, tp_degree=1, dtype="float32"
    )
    with S.model_parallel(1):
        module = B.NeuronGemma4(model.config, build, parallel=True, sdk=S.cpu_sdk())
    module.load_state_dict(
        B.convert_checkpoint(model.state_dict(), model.config, torch.float32), strict=False
    )
    graphs = E.AliasedGraphs(module, module, bucket=4)
    embed = model.get_input_embeddings()
    graphs(
        *B.step_inputs(
            embed(torch.tensor([[5, 6, 7, 8]])), [0, 1, 2, 3], 12, model.config.sliding_window
        )
    )
    graphs(*B.step_inputs(embed(torch.tensor([[9]])), [4], 12, model.config.sliding_window))
    assert graphs.calls == {"prefill": 1, "decode": 1}
    assert E._onehot_state_ok(graphs.state, 4) and not E._onehot_state_ok(graphs.state, 5)
    # the decode step was given the prefill's state (slots 0-3) and its output, slot 4 added, became
    # the state
    given, state = module.k_cache[0].detach(), graphs.state["k_cache.0"]
    assert torch.equal(given[:, :, :4], state[:, :, :4]) and given[:, :, 4:].abs().sum() == 0
    assert state[:, :, 4].abs().sum() > 0
    # a state the fp32 output cannot alias
    graphs.state["k_cache.0"] = graphs.state["k_cache.0"].double()
    with pytest.raises(RuntimeError, match=r"'k_cache\.0'.*shape and dtype"):
        graphs(*B.step_inputs(embed(torch.tensor([[9]])), [5], 12, model.config.sliding_window))
