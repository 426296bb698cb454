"""gemma_nb.experts: one family, so its strategies agree where they share math; one format
registry."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest  # noqa: E402
import torch  # noqa: E402

from gemma_nb import experts as E  # noqa: E402
from gemma_nb import formats, gemv, moe, quant  # noqa: E402
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
    sparse = E.Int8Experts.from_experts(float_experts, "gather", matmul="upcast")
    assert torch.equal(sparse.gate_up_proj, deploy.gate_up_proj)  # the same quantizer
    dense = sparse.sharing(kernel="dense")
    x = torch.randn(3, 64)
    index, weights = moe.random_routing(3, 16, 4, seed=2)
    assert torch.equal(deploy(x[:1], index[:1], weights[:1]), sparse(x[:1], index[:1], weights[:1]))
    assert torch.equal(deploy(x, index, weights), dense(x, index, weights))


@pytest.mark.parametrize("fmt", ["int8", "fp8", "mxfp4", "nvfp4"])
def test_every_kernel_runs_on_every_quantized_format(layer, fmt):
    config, float_experts = layer
    quantized = E.QuantizedExperts.from_experts(float_experts, fmt)
    x = torch.randn(5, 64)
    index, weights = moe.random_routing(5, 16, 4, seed=3)
    for tokens in (1, 5):  # one token: each kernel's decode path; five: 20 routes >= 16 experts
        want = quantized(x[:tokens], index[:tokens], weights[:tokens])
        for kernel in E.KERNELS:
            got = quantized.sharing(kernel=kernel)(x[:tokens], index[:tokens], weights[:tokens])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # fp32 sums, other order
    assert quantized.weight_bytes == sum(
        formats.tensor_bytes(shape, fmt)
        for shape in (quantized.gate_up.shape, quantized.down.shape)
    )


def test_each_kernel_says_the_bytes_it_reads(layer):
    config, float_experts = layer
    bf16 = moe.random_experts(config, seed=7)
    one_token = torch.tensor([[3, 5, 3, 9]])
    per_expert = {
        "bf16": bf16.gate_up_proj[0].nbytes + bf16.down_proj[0].nbytes,
        "int8": formats.tensor_bytes((64, 64), "int8") + formats.tensor_bytes((64, 32), "int8"),
    }
    reads = {"dense": 16, "sparse": 4, "gather": 4, "grouped": 3}  # grouped: expert 3 once
    for kernel, experts_read in reads.items():
        for fmt, module in (
            ("bf16", E.FloatExperts.from_experts(bf16, kernel)),
            ("int8", E.Int8Experts.from_experts(bf16, kernel)),
        ):
            assert module.read_bytes(one_token) == experts_read * per_expert[fmt], (kernel, fmt)


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
    with pytest.raises(ValueError, match="'bf16'.*int8, fp8, mxfp4, nvfp4"):
        formats.get_format("bf16", quantized=True)


def test_apply_scheme_quantizes_the_same_weights_the_same_way():
    config = random_gemma4_config(num_hidden_layers=2, num_experts=8, top_k_experts=2)
    first, second = (random_gemma4_model(config, seed=1, dtype=torch.float32) for _ in range(2))
    reports = [quant.apply_scheme(model, "int8_squeeze") for model in (first, second)]
    assert reports[0].equals(reports[1])
    assert torch.equal(
        first.model.layers[0].experts.gate_up.data, second.model.layers[0].experts.gate_up.data
    )


# (13, 2816): not in blocks of 4 rows, torch's kernel. The GEMV reads rows of 2816 int8 columns 4
# at a time, shorter ones one after another, 64 columns a step then 8 (48 and 16: only the 8s)
@pytest.mark.parametrize("shape", [(13, 2816), (1408, 2816), (2816, 704), (8, 48), (4, 16)])
def test_the_cpu_int8_kernel_is_the_upcast_matmul_rounded_once(shape):
    generator = torch.Generator().manual_seed(shape[0] + shape[1])
    q = torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator)
    scale = torch.rand(shape[0], 1, generator=generator) / 127
    x = torch.randn(1, shape[1], generator=generator).to(torch.bfloat16)
    exact = x.double() @ (q.double() * scale.double()).T
    got = gemv.int8_linear(x, q, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (1, shape[0])
    # the GEMV rounds the fp32 sum to bf16 once; torch's kernel (ATen without AVX2, no C compiler,
    # or rows not in blocks of 4) rounds the scale and, on its default path, partial sums too
    bound = 2.0**-8 if gemv.usable(x, q) else 2.0**-6
    assert ((got.double() - exact).abs() <= bound * exact.abs()).all()


@pytest.mark.parametrize("shape", [(13, 2816), (1408, 2816), (2816, 704), (8, 48), (5, 17)])
def test_one_bf16_token_s_matmul_is_the_fp32_sum_rounded_once(shape):
    generator = torch.Generator().manual_seed(shape[0])
    w = torch.randn(shape, generator=generator).to(torch.bfloat16)
    x = torch.randn(1, shape[1], generator=generator).to(torch.bfloat16)
    got, exact = gemv.linear(x, w), x.double() @ w.double().T
    assert got.dtype == torch.bfloat16 and got.shape == (1, shape[0])
    # one bf16 rounding (its unit roundoff: 2**-8 relative), plus fp32 summation error
    fp32_error = 2.0**-20 * (x.double().abs() @ w.double().abs().T)
    assert ((got.double() - exact).abs() <= 2.0**-8 * exact.abs() + fp32_error).all()
    x, w = x.float(), w.float()  # anything but one bf16 token: torch's own
    assert torch.equal(gemv.linear(x, w), torch.nn.functional.linear(x, w))
