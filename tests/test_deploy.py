"""Slim and naive deploys give the reference tokens; the neuron module's cpu variant decodes like
eager."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gemma_nb import export  # noqa: E402
from gemma_nb.artifact import ArtifactNotFoundError  # noqa: E402
from gemma_nb.evaluate import greedy_generate  # noqa: E402
from gemma_nb.experiments import slim_deploy as D  # noqa: E402
from gemma_nb.tiny import random_gemma4_config, random_gemma4_model  # noqa: E402

# 32 experts: two Int8Experts chunks
DIMS = dict(num_experts=32, top_k_experts=2, num_hidden_layers=2)
PROMPT = [5, 17, 99, 3, 250, 7]
SHAPES = dict(max_cache_len=32, prefill_len=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoint")
    figures = D.save_random_checkpoint(folder, DIMS, seed=3)
    return folder, figures


@pytest.fixture(scope="module")
def compiled(checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("artifact")
    result = D.compile_checkpoint(checkpoint[0], folder, PROMPT, 12, SHAPES, latency_steps=3)
    return folder, result


def test_int8_experts_equal_quantized_experts_and_squeeze_equals_apply_scheme():
    from gemma_nb.experts import Int8Experts, QuantizedExperts
    from gemma_nb.quant import apply_scheme

    reference = random_gemma4_model(random_gemma4_config(**DIMS), seed=1, dtype=torch.float32)
    squeezed = random_gemma4_model(random_gemma4_config(**DIMS), seed=1, dtype=torch.float32)
    apply_scheme(reference, "int8_squeeze")
    report = D.int8_squeeze(squeezed)
    assert set(report["group"]) == {"experts", "shared_mlp", "lm_head"}
    experts = reference.model.layers[0].experts
    assert isinstance(experts, QuantizedExperts)
    ours = Int8Experts.from_quantized(experts)
    torch.manual_seed(0)
    for tokens in (1, 5):  # decode (gather) and prefill (dense, chunked) paths
        x = torch.randn(tokens, 128)
        index = torch.stack([torch.randperm(32)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2)
        torch.testing.assert_close(
            ours(x, index, weights), experts(x, index, weights), rtol=1e-5, atol=1e-6
        )
    ids = torch.tensor([PROMPT])
    assert torch.equal(greedy_generate(squeezed, ids, 12), greedy_generate(reference, ids, 12))


def test_slim_and_naive_give_the_reference_tokens(checkpoint, compiled):
    artifact, result = compiled
    reference = result["reference_tokens"]
    assert len(reference) == 12
    slim = D.SlimDeploy(artifact)
    naive = D.NaiveDeploy(checkpoint[0])
    ids = torch.tensor([PROMPT])
    assert slim.generate(ids, 12)[0, len(PROMPT) :].tolist() == reference
    assert naive.generate(ids, 12)[0, len(PROMPT) :].tolist() == reference
    # The skeleton holds no memory; the weights are int8 where squeezed.
    assert all(p.is_meta for p in slim.skeleton.parameters())
    assert slim.artifact.weights["model.layers.0.experts.gate_up_proj"].dtype == torch.int8
    assert slim.artifact.manifest["scheme"] == "int8_squeeze"
    # the manifest names what runs the experts: the deploy's Int8Experts, not transformers' default
    assert slim.artifact.manifest["experts_implementation"] == "Int8Experts"
    assert result["exported_decode_ms"] > 0 and result["eager_decode_ms"] > 0


def test_measured_slim_deploy_in_a_fresh_process(compiled):
    artifact, result = compiled
    run = D.measure_deploy("slim", artifact, PROMPT, 12, interval_s=0.02)
    assert run["tokens"] == result["reference_tokens"]
    assert (
        run["peak_rss_bytes"] > 100e6 and run["peak_hwm_bytes"] >= run["self_peak_rss_bytes"] * 0.99
    )
    assert 0 < run["load_s"] < run["first_token_s"] < run["cold_start_s"]


def test_slim_deploy_refuses_a_bad_embedding_scale(compiled, tmp_path):
    import shutil

    from gemma_nb.embedding import EmbeddingScaleError, HostEmbedding

    artifact = tmp_path / "artifact"
    shutil.copytree(compiled[0], artifact)
    path = export.host_embedding_path(artifact)
    table = HostEmbedding.from_file(path).weight
    HostEmbedding(table, 1.0).save(path)  # the story's bug: the table without its sqrt(H) scale
    with pytest.raises(EmbeddingScaleError, match="embed_scale"):
        D.SlimDeploy(artifact)


def test_slim_deploy_names_a_missing_file(compiled, tmp_path):
    import shutil

    artifact = tmp_path / "artifact"
    shutil.copytree(compiled[0], artifact)
    (artifact / "embed_tokens.safetensors").unlink()
    with pytest.raises(ArtifactNotFoundError, match="embed_tokens.safetensors"):
        D.SlimDeploy(artifact)


def test_performance_targets_are_headline_rows_with_their_verdicts():
    rows = D.performance_targets(
        {"peak_rss_bytes": 1.0}, {"peak_rss_bytes": 4.0}, {"exported_over_eager": 1.5}
    )
    assert [(row["value"], row["at_most"], row["met"]) for row in rows] == [
        (0.25, 0.35, True),
        (1.5, 1.3, False),
    ]


# ---- the neuron recipe's traced module, on the cpu --------------------------------------------
def test_write_positions_writes_only_its_slots():
    from gemma_nb.neuron.build import step_inputs, write_positions

    cache = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(1, 2, 6, 3)
    new = -torch.ones(1, 2, 2, 3, dtype=torch.bfloat16)
    _, positions, full, sliding, last = step_inputs(
        torch.zeros(1, 2, 4), [2, 3], max_len=6, sliding_window=2
    )
    out = write_positions(cache, new, positions)
    assert out.dtype == torch.float32 and torch.equal(out[:, :, 2:4], new.float())
    assert torch.equal(out[:, :, :2], cache[:, :, :2])
    assert torch.equal(out[:, :, 4:], cache[:, :, 4:])
    assert positions.tolist() == [[2, 3]] and last.tolist() == [1]
    # query at position 3 sees slots 0..3 (full) and 2..3 (sliding window of 2)
    assert (full[0, 0, 1] == 0).tolist() == [True] * 4 + [False] * 2
    assert (sliding[0, 0, 1] == 0).tolist() == [False, False, True, True, False, False]


def test_neuron_module_cpu_variant_decodes_like_eager():
    from cpu_state_graph import CpuStateGraph

    from gemma_nb.neuron.build import NeuronBuildConfig, NeuronGemma4
    from gemma_nb.neuron.deploy import NeuronStepRunner

    # A sliding window of 8 is crossed within the 26 positions decoded.
    model = random_gemma4_model(random_gemma4_config(sliding_window=8), seed=0, dtype=torch.float32)
    build = NeuronBuildConfig(
        model_dir="unused", output_dir="unused", max_len=32, bucket=8, dtype="float32"
    )
    module = NeuronGemma4(model.config, build, parallel=False)
    module.load_state(model.state_dict())
    runner = NeuronStepRunner(
        CpuStateGraph(module), model.get_input_embeddings(), model.config, 32, 8
    )
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(runner.generate(ids, 20), greedy_generate(model, ids, 20))
    assert len(module.input_output_aliases()) == 2 * model.config.num_hidden_layers


def test_a_bfloat16_kv_state_gives_the_bfloat16_graph_the_same_logits():
    """A bf16 graph's K and V are bf16 values: the port's fp32 state holds them exactly, and a bf16
    state (half the bytes) holds the same values, so every step's logits are equal bit for bit."""
    from cpu_state_graph import CpuStateGraph

    from gemma_nb.neuron.build import NeuronBuildConfig, NeuronGemma4
    from gemma_nb.neuron.deploy import NeuronStepRunner

    # A sliding window of 8 is crossed within the 26 positions decoded.
    model = random_gemma4_model(random_gemma4_config(sliding_window=8), seed=0)
    logits = {}
    for kv_dtype in ("float32", "bfloat16"):
        build = NeuronBuildConfig("unused", "unused", max_len=32, bucket=8, kv_dtype=kv_dtype)
        module = NeuronGemma4(model.config, build, parallel=False)
        module.load_state(model.state_dict())
        assert {s.dtype for s in [*module.k_cache, *module.v_cache]} == {getattr(torch, kv_dtype)}
        state, logits[kv_dtype] = CpuStateGraph(module), []

        def graph(*inputs, state=state, seen=logits[kv_dtype]):
            seen.append(state(*inputs))
            return seen[-1]

        runner = NeuronStepRunner(graph, model.get_input_embeddings(), model.config, 32, 8)
        with torch.no_grad():
            runner.generate(torch.tensor([PROMPT]), 20)
    assert len(logits["bfloat16"]) == 20
    assert all(map(torch.equal, logits["float32"], logits["bfloat16"]))


def test_neuron_checkpoint_layout_reproduces_the_experts():
    """convert_checkpoint's experts: NxD's expert-major int8 layout ([E, H, 2I] and [E, I, H], one
    fp32 scale per expert and output channel), the same for any TP degree; the stride-2 split gives
    each rank its slice of the gate half and of the up half, and the math summed over two ranks
    equals transformers' experts."""
    from transformers.activations import ACT2FN

    from gemma_nb.neuron.build import convert_checkpoint
    from gemma_nb.rehearsal.sharding import local_slice

    model = random_gemma4_model(
        random_gemma4_config(num_hidden_layers=1), seed=2, dtype=torch.float32
    )
    config = model.config
    state = convert_checkpoint(model.state_dict(), config)
    assert (
        state["lm.lm_head.weight"].dtype == torch.int8
        and "lm.model.embed_tokens.weight" not in state
    )
    assert state["lm.model.layers.0.mlp.gate_proj.weight"].dtype == torch.int8
    assert not any(key.endswith(".rank") for key in state)  # no rank id in the graph
    e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
    base = "lm.model.layers.0.experts"
    assert state[f"{base}.gate_up.weight"].shape == (e, h, 2 * i) and state[
        f"{base}.gate_up.scale"
    ].shape == (e, 1, 2 * i)
    assert state[f"{base}.down.weight"].shape == (e, i, h) and state[
        f"{base}.down.scale"
    ].shape == (e, 1, h)
    gate_up = state[f"{base}.gate_up.weight"].float() * state[f"{base}.gate_up.scale"]  # [E, H, 2I]
    down = state[f"{base}.down.weight"].float() * state[f"{base}.down.scale"]  # [E, I, H]
    source = model.model.layers[0].experts
    for rank in range(2):  # rank 1's gate columns of expert 3 are gate rows I/2..I of that expert
        mine = local_slice(gate_up, rank, 2, dim=2, stride=2)
        expected = source.gate_up_proj[3, rank * i // 2 : (rank + 1) * i // 2].T
        assert (mine[3, :, : i // 2] - expected).abs().max() <= expected.abs().max() / 100
    torch.manual_seed(0)
    x = torch.randn(3, h)
    index = torch.stack([torch.randperm(e)[: config.top_k_experts] for _ in range(3)])
    weights = torch.rand(3, config.top_k_experts)
    dense = torch.zeros(3, e).scatter(1, index, weights)
    ours = 0
    for rank in range(2):
        gate, up = (
            torch.einsum("th,ehi->eti", x, local_slice(gate_up, rank, 2, dim=2, stride=2))
        ).chunk(2, dim=-1)
        hidden = ACT2FN[config.hidden_activation](gate) * up  # [E, T, I/2]
        out = torch.einsum("eti,eih->eth", hidden, local_slice(down, rank, 2, dim=1, stride=1))
        ours = ours + (out * dense.T[..., None]).sum(0)
    expected = source(x, index, weights)
    assert (ours - expected).norm() / expected.norm() < 0.02


def test_neuron_module_with_stand_in_layers_takes_the_converted_checkpoint():
    """The NxD swaps with the cpu stand-ins at TP=1: the module's state-dict names and shapes are
    exactly the ones convert_checkpoint writes, and the model decodes close to the eager one."""
    from cpu_state_graph import CpuStateGraph

    from gemma_nb.neuron import build as B
    from gemma_nb.neuron.deploy import NeuronStepRunner
    from gemma_nb.rehearsal import standins

    model = random_gemma4_model(
        random_gemma4_config(num_hidden_layers=2), seed=4, dtype=torch.float32
    )
    build = B.NeuronBuildConfig(
        model_dir="unused", output_dir="unused", max_len=24, bucket=8, tp_degree=1, dtype="float32"
    )
    with standins.model_parallel(1):
        module = B.NeuronGemma4(model.config, build, parallel=True, sdk=standins.cpu_sdk())
    state = B.convert_checkpoint(model.state_dict(), model.config, dtype=torch.float32)
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items() if "_cache." not in k}
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    module.load_state_dict(state, strict=False)
    runner = NeuronStepRunner(
        CpuStateGraph(module), model.get_input_embeddings(), model.config, 24, 8
    )
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = runner.step(ids, list(range(len(PROMPT))), len(PROMPT) - 1)
        reference = model(ids).logits[:, -1]
    assert (logits.argmax(-1) == reference.argmax(-1)).all()
    assert (logits - reference).abs().max() < 0.05 * reference.abs().max()
    assert runner.generate(ids, 4).shape == (1, len(PROMPT) + 4)


def test_hub_checkpoint_keys_map_to_the_text_model():
    from gemma_nb.neuron.checkpoint import text_key

    assert (
        text_key("model.language_model.layers.3.experts.down_proj")
        == "model.layers.3.experts.down_proj"
    )
    assert text_key("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert (
        text_key("model.layers.0.self_attn.q_proj.weight")
        == "model.layers.0.self_attn.q_proj.weight"
    )
    assert text_key("model.vision_tower.encoder.layers.0.mlp.fc1.weight") is None
    assert text_key("model.embed_vision.embedding_projection.weight") is None
