"""gemma_nb.experts: one family, so its strategies agree where they share math; one format
registry."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest  # noqa: E402
import torch  # noqa: E402

from gemma_nb import experts as E  # noqa: E402
from gemma_nb import formats, moe, quant  # noqa: E402
from gemma_nb.tiny import random_gemma4_config, random_gemma4_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def layer():
    config = random_gemma4_config(
        num_hidden_layers=1,
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=16,
        top_k_experts=4,
    )
    return config, moe.random_experts(config, seed=7, dtype=torch.float32)


def test_int8_experts_are_the_sparse_gather_and_dense_upcast_strategies_bit_for_bit(layer):
    config, float_experts = layer
    quantized = E.QuantizedExperts.from_experts(float_experts, "int8")
    deploy = E.Int8Experts.from_quantized(quantized)
    assert deploy.gate_up_proj.data_ptr() == quantized.gate_up_data.data_ptr()  # shared, not copied
    sparse = E.SparseExperts.sharing(
        deploy, int8_kernel="upcast", selection="gather", compute_dtype=torch.float32
    )
    dense = E.DenseExperts.sharing(sparse)
    x = torch.randn(3, 64)
    index, weights = moe.random_routing(3, 16, 4, seed=2)
    assert torch.equal(deploy(x[:1], index[:1], weights[:1]), sparse(x[:1], index[:1], weights[:1]))
    assert torch.equal(deploy(x, index, weights), dense(x, index, weights))


@pytest.mark.parametrize("fmt", ["int8", "fp8", "mxfp4", "nvfp4"])
def test_every_strategy_runs_on_every_quantized_format(layer, fmt):
    config, float_experts = layer
    quantized = E.QuantizedExperts.from_experts(float_experts, fmt)
    x = torch.randn(5, 64)
    index, weights = moe.random_routing(5, 16, 4, seed=3)
    want = quantized(x, index, weights)
    for cls in (E.DenseExperts, E.SparseExperts):
        got = cls.sharing(quantized)(x, index, weights)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # fp32 sums in another order
    assert quantized.weight_bytes == sum(
        formats.tensor_bytes(shape, fmt)
        for shape in (quantized.gate_up.shape, quantized.down.shape)
    )
    with pytest.raises(
        AssertionError, match=f"selection 'gather' needs float or int8 weights, not {fmt}"
    ):
        E.SparseExperts.sharing(quantized, selection="gather")


def test_dense_router_weights_put_the_top_k_weights_in_place():
    index = torch.tensor([[2, 0], [1, 3]])
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5]], dtype=torch.bfloat16)
    dense = E.dense_router_weights(index, weights, 4)
    assert dense.dtype == torch.float32
    assert dense.tolist() == [[0.25, 0.0, 0.75, 0.0], [0.0, 0.5, 0.0, 0.5]]


def test_one_format_registry_for_the_planner_and_the_quantizers():
    assert list(formats.QUANTIZED_FORMATS) == ["int8", "fp8", "mxfp4", "nvfp4"]
    assert all(f is formats.get_format(name) for name, f in formats.QUANTIZED_FORMATS.items())
    assert [name for name, f in formats.FORMATS.items() if not f.quantized] == [
        "fp32",
        "bf16",
        "fp16",
    ]
    assert formats.tensor_bytes((2, 32), "int8") == 2 * (32 + 4)  # an fp32 scale per row
    # an e4m3 scale per block, fp32 per matrix
    assert formats.tensor_bytes((2, 32), "nvfp4") == 2 * 2 * (8 + 1) + 4
    with pytest.raises(
        ValueError, match="weight format 'bf16' is not one of int8, fp8, mxfp4, nvfp4"
    ):
        formats.get_format("bf16", quantized=True)


def test_apply_scheme_quantizes_the_same_weights_the_same_way():
    config = random_gemma4_config(num_hidden_layers=2, num_experts=8, top_k_experts=2)
    first, second = (random_gemma4_model(config, seed=1, dtype=torch.float32) for _ in range(2))
    reports = [quant.apply_scheme(model, "int8_squeeze") for model in (first, second)]
    assert reports[0].equals(reports[1])
    assert torch.equal(
        first.model.layers[0].experts.gate_up.data, second.model.layers[0].experts.gate_up.data
    )
