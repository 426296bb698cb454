"""The expert kernels: same tokens as transformers, bf16 agreement, export, bad input."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from gemma_nb import experts as E
from gemma_nb import gemv, moe
from gemma_nb.evaluate import greedy_generate
from gemma_nb.formats import dequantize_int8
from gemma_nb.gemv import int8pack_usable
from gemma_nb.tiny import BUNDLED_ID, random_gemma4_config

NEW_TOKENS = 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bundled():
    from gemma_nb.modelio import load_model

    model, tokenizer = load_model(BUNDLED_ID, dtype=torch.float32)
    prompts = [tokenizer(text, return_tensors="pt").input_ids for text in _prompts()]
    return model, prompts


def _prompts():
    from gemma_nb.tiny import fact_prompts

    return fact_prompts()[:3]


def experts_kind(model) -> str:
    """Which implementation the model's experts use now (transformers, dense, sparse_int8, ...)."""
    kinds = set()
    for _, _, module in moe.experts_modules(model):
        if not isinstance(module, E.RoutedExperts):
            kinds.add("transformers")
        else:
            kinds.add(f"{module.kernel}_int8" if module.fmt == "int8" else module.kernel)
    return ",".join(sorted(kinds))


def _generate(model, prompts):
    return [greedy_generate(model, ids, NEW_TOKENS) for ids in prompts]


def test_dense_and_sparse_match_transformers_greedy_tokens_on_bundled_checkpoint(bundled):
    model, prompts = bundled
    moe.swap_experts(model, "transformers")
    reference = _generate(model, prompts)
    try:
        for impl in E.KERNELS:
            moe.swap_experts(model, impl)
            assert experts_kind(model) == impl
            for got, want in zip(_generate(model, prompts), reference):
                assert torch.equal(got, want), f"{impl} diverged from transformers"
    finally:
        moe.swap_experts(model, "transformers")
    assert experts_kind(model) == "transformers"


def test_int8_dense_and_sparse_match_transformers_on_the_dequantized_weights(bundled):
    model, prompts = bundled
    layers = moe.experts_modules(model)
    originals = [(module.gate_up_proj, module.down_proj) for _, _, module in layers]
    int8_modules = [E.Int8Experts.from_experts(module) for _, _, module in layers]
    try:
        # Reference: transformers' experts on q * scale (what int8 weights mean), fp32 activations.
        for (_, _, module), quantized in zip(layers, int8_modules):
            module.gate_up_proj = torch.nn.Parameter(
                dequantize_int8(quantized.gate_up_proj, quantized.gate_up_scale)
            )
            module.down_proj = torch.nn.Parameter(
                dequantize_int8(quantized.down_proj, quantized.down_scale)
            )
        reference = _generate(model, prompts)
        for kernel in ("sparse", "dense"):
            for (parent, name, _), quantized in zip(layers, int8_modules):
                setattr(parent, name, quantized.sharing(kernel=kernel, compute_dtype=torch.float32))
            for got, want in zip(_generate(model, prompts), reference):
                assert torch.equal(got, want), f"{kernel} int8 diverged"
    finally:
        for (parent, name, module), (gate_up, down) in zip(layers, originals):
            module.gate_up_proj, module.down_proj = gate_up, down
            setattr(parent, name, module)


def test_swap_shares_the_weight_tensors_and_reverts():
    from gemma_nb.tiny import random_gemma4_model

    model = random_gemma4_model(random_gemma4_config(num_hidden_layers=2), dtype=torch.float32)
    before = [m.gate_up_proj.data_ptr() for _, _, m in moe.experts_modules(model)]
    moe.swap_experts(model, "sparse")
    assert [m.gate_up_proj.data_ptr() for _, _, m in moe.experts_modules(model)] == before
    moe.swap_experts(model, "dense")
    moe.swap_experts(model, "transformers")
    assert experts_kind(model) == "transformers"
    assert [m.gate_up_proj.data_ptr() for _, _, m in moe.experts_modules(model)] == before
    moe.swap_experts(model, "sparse_int8")
    layer = moe.experts_modules(model)[0][2]
    assert layer.gate_up_proj.dtype == torch.int8 and layer.gate_up_scale.shape == (32, 128, 1)


# A mid-size layer: large enough that bf16 rounding accumulates over real matmul lengths.
MID = dict(hidden_size=1024, moe_intermediate_size=256, num_experts=64, top_k_experts=8)


@pytest.fixture(scope="module")
def mid_layer():
    config = random_gemma4_config(num_hidden_layers=1, **MID)
    return config, moe.random_experts(config, seed=1, dtype=torch.bfloat16)


def _fp32_reference(experts, config, x, index, weights):
    """transformers' eager experts on fp32 copies of the same bf16 weights: the exact answer."""
    fp32 = moe.make_experts(experts, "transformers", config=config, experts_implementation="eager")
    fp32.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.float())
    fp32.down_proj = torch.nn.Parameter(experts.down_proj.float())
    return fp32(x.float(), index, weights)


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_bf16_dense_and_sparse_agree_within_bf16_rounding_at_mid_size(mid_layer, tokens):
    config, experts = mid_layer
    torch.manual_seed(tokens)
    x = torch.randn(tokens, config.hidden_size, dtype=torch.bfloat16)
    index, weights = moe.random_routing(
        tokens, config.num_experts, config.top_k_experts, seed=tokens
    )
    exact = _fp32_reference(experts, config, x, index, weights)
    scale = exact.abs().max().item()
    bf16_eps = 2.0**-8
    outputs = {}
    for name, module in (
        ("dense", E.FloatExperts.from_experts(experts, "dense")),
        ("sparse", E.FloatExperts.from_experts(experts, "sparse")),
        ("gather", E.FloatExperts.from_experts(experts, "gather")),
    ):
        out = module(x, index, weights)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        # Two bf16 roundings inside each expert (gate/up and down outputs) plus the final cast.
        assert (out.float() - exact).abs().max().item() <= 4 * bf16_eps * scale, name
        outputs[name] = out.float()
    assert (outputs["dense"] - outputs["sparse"]).abs().max().item() <= 2 * bf16_eps * scale


def test_int8_fused_kernel_matches_the_upcast_reference(mid_layer):
    config, experts = mid_layer
    fused = E.Int8Experts.from_experts(experts)
    upcast = fused.sharing(matmul="upcast")
    dense = fused.sharing(kernel="dense")
    x = torch.randn(1, config.hidden_size, dtype=torch.bfloat16)
    assert int8pack_usable(x, fused.gate_up_proj[0])
    index, weights = moe.random_routing(1, config.num_experts, config.top_k_experts, seed=5)
    want = upcast(x, index, weights).float()
    scale = want.abs().max().item()
    for got in (fused(x, index, weights), dense(x, index, weights)):
        # The fused kernels round each output to bf16 once, and torch's also rounds the fp32
        # scales to bf16 (as gpt-fast stores them): ~1 ulp per row.
        assert (got.float() - want).abs().max().item() <= 4 * 2.0**-8 * scale
    assert fused.weight_bytes == config.num_experts * 3 * 1024 * 256 + 4 * config.num_experts * (
        512 + 1024
    )


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("kernel", ["sparse", "gather"])
def test_sparse_decode_path_exports_with_static_shapes(int8, kernel):
    config = random_gemma4_config(
        num_hidden_layers=1,
        hidden_size=256,
        moe_intermediate_size=64,
        num_experts=32,
        top_k_experts=4,
    )
    experts = moe.random_experts(config, seed=2)
    module = (E.Int8Experts if int8 else E.FloatExperts).from_experts(experts, kernel)
    x = torch.randn(1, config.hidden_size, dtype=torch.bfloat16)
    index, weights = moe.random_routing(1, config.num_experts, config.top_k_experts, seed=0)
    program = torch.export.export(module, (x, index, weights))
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert ("aten.index.Tensor" in targets) == (kernel == "gather")
    # the cpu's GEMV (or int8 kernel), where gather upcasts the K experts it copied
    fused = {"aten._weight_int8pack_mm.default", "gemma_nb.gemv.default"} & targets
    assert bool(fused) == (
        kernel == "sparse" and (int8 or gemv.kernel_name() == "gemma_nb AVX2 GEMV")
    )
    other_index, other_weights = moe.random_routing(
        1, config.num_experts, config.top_k_experts, seed=9
    )
    assert torch.equal(
        program.module()(x, other_index, other_weights), module(x, other_index, other_weights)
    )


def test_int8pack_guard_refuses_shapes_the_cpu_kernel_cannot_handle():
    q = torch.zeros(8, 40, dtype=torch.int8)
    assert not int8pack_usable(torch.zeros(1, 40, dtype=torch.bfloat16), q)  # 40 % 16 != 0
    assert not int8pack_usable(
        torch.zeros(1, 48, dtype=torch.float32), torch.zeros(8, 48, dtype=torch.int8)
    )
    assert not int8pack_usable(
        torch.zeros(1, 49, dtype=torch.bfloat16)[:, 1:], torch.zeros(8, 48, dtype=torch.int8)
    )
    assert int8pack_usable(
        torch.zeros(1, 48, dtype=torch.bfloat16), torch.zeros(8, 48, dtype=torch.int8)
    )


def test_neuron_checkpoints_shard_to_the_same_layer_output_dense_and_sparse():
    """The NxD experts on the cpu stand-ins: one checkpoint, split across 2 ranks by the emulated
    ModelBuilder, each rank's partial output (no collective: group=None) summed as the all-reduce
    would: dense and sparse hold the same parameters (NxD's expert-fused int8 layers, expert-major)
    and give the same output, equal to the layer."""
    from gemma_nb.neuron import expert_mlps as neuron_moe
    from gemma_nb.rehearsal import standins

    config = random_gemma4_config(
        num_hidden_layers=1,
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=16,
        top_k_experts=3,
    )
    experts = moe.random_experts(config, seed=3, dtype=torch.float32)
    x = torch.randn(3, 64)
    index, weights = moe.random_routing(3, 16, 3, seed=1)
    tp = 2
    checkpoint = neuron_moe.experts_checkpoint(experts.gate_up_proj, experts.down_proj)
    sdk = standins.cpu_sdk()
    outputs, shapes = {}, {}
    for mode, cls in (
        ("dense", neuron_moe.NeuronDenseExperts),
        ("sparse", neuron_moe.NeuronSparseExperts),
    ):

        def factory():
            return cls(16, 64, 32, tp, dtype=torch.float32, sdk=sdk)

        total = 0
        for rank in range(tp):
            module = standins.load_rank_module(factory, checkpoint, tp, rank)
            shapes[mode] = {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}
            total = total + module(x, index, weights)
        outputs[mode] = total
    assert shapes["dense"] == shapes["sparse"]
    assert shapes["dense"]["gate_up.weight"] == ((16, 64, 2 * 16), torch.int8)
    assert shapes["dense"]["gate_up.scale"] == ((16, 1, 2 * 16), torch.float32)
    assert shapes["dense"]["down.weight"] == ((16, 16, 64), torch.int8)
    assert shapes["dense"]["down.scale"] == ((16, 1, 64), torch.float32)  # replicated on every rank
    assert torch.allclose(outputs["dense"], outputs["sparse"], atol=1e-5, rtol=1e-5)
    reference = E.FloatExperts.from_experts(experts)(x, index, weights)
    assert (outputs["sparse"] - reference).abs().max().item() <= 0.02 * reference.abs().max().item()


def test_sparse_experts_refuse_a_prefill_and_need_no_dequantize_patch():
    """Selective loading is the decode path (tokens x top_k < experts, NxD's rule); the expert-fused
    layers' 4-D outputs take NxD's own in-place scale_dequantize, unpatched."""
    from gemma_nb.neuron import expert_mlps as neuron_moe
    from gemma_nb.rehearsal import standins

    sdk = standins.cpu_sdk()  # unpatched: NxD 0.18's in-place scale_dequantize
    with standins.model_parallel(1):
        dense = neuron_moe.NeuronDenseExperts(16, 64, 32, 1, sdk=sdk, dtype=torch.float32)
        sparse = neuron_moe.NeuronSparseExperts(16, 64, 32, 1, sdk=sdk, dtype=torch.float32)
    index, weights = moe.random_routing(4, 16, 4, seed=1)
    assert dense(torch.randn(4, 64), index, weights).shape == (4, 64)
    assert sparse(torch.randn(3, 64), index[:3], weights[:3]).shape == (3, 64)


def test_sparse_decode_all_reduces_in_fp32_like_row_parallel_linear():
    from types import SimpleNamespace

    from gemma_nb.neuron import expert_mlps as neuron_moe
    from gemma_nb.rehearsal import standins

    reduced = []

    def recording_reduce(tensor, process_group=None):
        reduced.append(tensor.dtype)
        return tensor

    sdk = standins.cpu_sdk()
    sdk.mappings = SimpleNamespace(**vars(sdk.mappings))
    sdk.mappings.reduce_from_tensor_model_parallel_region = recording_reduce
    with standins.model_parallel(1):
        sparse = neuron_moe.NeuronSparseExperts(16, 64, 32, 1, sdk=sdk, dtype=torch.bfloat16)
    index, weights = moe.random_routing(1, 16, 4, seed=1)
    out = sparse(torch.randn(1, 64, dtype=torch.bfloat16), index, weights)
    assert reduced == [torch.float32] and out.dtype == torch.bfloat16
