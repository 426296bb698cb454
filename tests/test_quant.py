"""gemma_nb.quant: int8 / fp8 / MXFP4 / NVFP4 formats, quantized modules, schemes on a Gemma-4
model."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gemma_nb import formats, memory, quant  # noqa: E402
from gemma_nb.experts import QuantizedExperts  # noqa: E402
from gemma_nb.formats import (  # noqa: E402
    FP4_E2M1_VALUES,
    dequantize_int8,
    int8_matmul,
    pack_fp4,
    quantize,
    quantize_int8_per_channel,
    unpack_fp4,
)
from gemma_nb.formats import QUANTIZED_FORMATS as FORMATS  # noqa: E402
from gemma_nb.quant import Int8Linear, apply_scheme  # noqa: E402

FAST = settings(max_examples=40, deadline=None)


pytestmark = pytest.mark.usefixtures("one_thread")

E4M3_MAX = 448.0


def unpack_fp4_codes(packed):
    """bytes [..., m] -> uint8 codes [..., 2m], element 2j from the low nibble (pack_fp4's
    inverse)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _rows(draw, max_rows=6, max_cols=70):
    rows = draw(st.integers(1, max_rows))
    cols = draw(st.integers(1, max_cols))
    return rows, cols


# ---------------------------------------------------------------------------------------------
# int8
# ---------------------------------------------------------------------------------------------


@FAST
@given(st.data())
def test_int8_error_is_at_most_half_a_step_per_element(data):
    rows, cols = _rows(data.draw)
    seed = data.draw(st.integers(0, 2**16))
    magnitude = data.draw(st.sampled_from([1e-6, 1e-2, 1.0, 1e4]))
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * magnitude
    q, scale = quantize_int8_per_channel(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (rows, 1)
    assert int(q.abs().max()) <= 127
    error = (dequantize_int8(q, scale) - weight).abs()
    # half a step, plus fp32 rounding of q * scale
    assert bool((error <= scale * 0.5 * (1 + 1e-5) + 1e-30).all())


@FAST
@given(st.data())
def test_int8_exactly_representable_rows_round_trip_exactly(data):
    rows, cols = _rows(data.draw)
    codes = torch.tensor(
        data.draw(st.lists(st.integers(-127, 127), min_size=rows * cols, max_size=rows * cols)),
        dtype=torch.float32,
    ).view(rows, cols)
    codes[:, 0] = torch.tensor(
        data.draw(st.lists(st.sampled_from([-127, 127]), min_size=rows, max_size=rows)),
        dtype=torch.float32,
    )
    exponents = torch.tensor(
        data.draw(st.lists(st.integers(-20, 10), min_size=rows, max_size=rows))
    )
    weight = codes * torch.exp2(exponents.float())[:, None]
    q, scale = quantize_int8_per_channel(weight)
    assert torch.equal(dequantize_int8(q, scale), weight)
    assert torch.equal(q.float(), codes)


def test_int8_zero_row_outlier_and_port_formula():
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    weight[1] = 0.0
    weight[2, 5] = 1e6  # one huge outlier: its row collapses to {0, +127}, other rows unaffected
    q, scale = quantize_int8_per_channel(weight)
    assert scale[1, 0] == formats.INT8_MIN_SCALE and int(q[1].abs().sum()) == 0
    assert torch.equal(dequantize_int8(q, scale)[1], torch.zeros(64))
    assert q[2, 5] == 127 and int((q[2] != 0).sum()) == 1
    clean, clean_scale = quantize_int8_per_channel(weight[[0, 3]])
    assert torch.equal(q[[0, 3]], clean) and torch.equal(scale[[0, 3]], clean_scale)
    # the port's formula, literally
    expected_scale = (weight.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-8)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q, torch.round(weight / expected_scale).clamp(-127, 127).to(torch.int8))


def test_int8_stacks_quantize_per_expert():
    stack = torch.randn(3, 5, 7)
    q, scale = quantize_int8_per_channel(stack)
    assert scale.shape == (3, 5, 1)
    for e in range(3):
        qe, se = quantize_int8_per_channel(stack[e])
        assert torch.equal(q[e], qe) and torch.equal(scale[e], se)


def test_quantize_int8_equals_the_port_quantizer_even_in_small_chunks(monkeypatch):
    weight = torch.randn(2, 48, 40, dtype=torch.bfloat16)
    q, scale = quantize_int8_per_channel(weight)
    monkeypatch.setattr(formats, "CHUNK_ELEMENTS", 7 * 40)  # chunks cut across the two experts
    qt = quantize(weight, "int8")
    assert torch.equal(qt.data, q) and torch.equal(qt.scale, scale)


def test_int8_matmul_follows_nxd_order_and_splits_by_rows_exactly():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 40, generator=generator)
    q, scale = quantize_int8_per_channel(weight)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 40, generator=generator).to(dtype)
        y = int8_matmul(x, q, scale)
        assert y.dtype == dtype and y.shape == (3, 5, 96)
        expected = (torch.nn.functional.linear(x, q.to(dtype)).float() * scale.T).to(dtype)
        assert torch.equal(y, expected)
        shards = [int8_matmul(x, q[a:b], scale[a:b]) for a, b in ((0, 48), (48, 96))]
        assert torch.equal(torch.cat(shards, dim=-1), y)
    x32 = torch.randn(4, 40, generator=generator)
    torch.testing.assert_close(
        int8_matmul(x32, q, scale), x32 @ dequantize_int8(q, scale).T, rtol=1e-5, atol=1e-5
    )


def test_int8_linear_module():
    linear = torch.nn.Linear(40, 24, bias=False)
    module = Int8Linear.from_weight(linear.weight, name="mlp.up_proj.weight")
    assert module.nbytes == 24 * 40 + 24 * 4 == memory.tensor_bytes((24, 40), "int8")
    x = torch.randn(2, 40)
    assert torch.equal(module(x), int8_matmul(x, module.qweight, module.scale))
    assert set(module.state_dict()) == {"qweight", "scale"}


# ---------------------------------------------------------------------------------------------
# fp8 and fp4
# ---------------------------------------------------------------------------------------------


def e2m1_codes(x):
    """E2M1 codes of signed fp32 values, as ``formats.quantize`` splits them: magnitudes and
    signs."""
    return formats.e2m1_codes(x.abs(), x < 0)


def test_fp4_codes_pack_and_unpack_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = pack_fp4(codes)
    # element 2j in the low nibble
    assert packed.tolist() == [
        0x10,
        0x32,
        0x54,
        0x76,
        0x98,
        0xBA,
        0xDC,
        0xFE,
    ]
    assert torch.equal(unpack_fp4_codes(packed), codes)
    assert torch.equal(unpack_fp4(packed), torch.tensor(FP4_E2M1_VALUES))
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_fp4(unpack_fp4_codes(every_byte)), every_byte)
    assert torch.equal(e2m1_codes(torch.tensor(FP4_E2M1_VALUES))[:8], codes[:8])


def test_e2m1_rounding_ties_to_even_and_saturates():
    def round_to_e2m1(x):
        return torch.tensor(FP4_E2M1_VALUES)[e2m1_codes(x).long()]

    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert round_to_e2m1(midpoints).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert round_to_e2m1(-midpoints).tolist() == [0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    assert round_to_e2m1(torch.tensor([7.0, -1e9, 0.26, -0.2])).tolist() == [6.0, -6.0, 0.5, 0.0]
    assert e2m1_codes(torch.tensor([-0.2, -0.0])).tolist() == [0, 0]  # never a negative-zero code


@FAST
@given(st.data())
def test_fp8_representable_values_round_trip_and_error_bound(data):
    rows, cols = _rows(data.draw)
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    grid = torch.randn(rows, cols, generator=generator).mul(100).clamp(-E4M3_MAX, E4M3_MAX)
    grid = grid.to(torch.float8_e4m3fn).float()
    grid[:, 0] = E4M3_MAX
    exponents = torch.tensor(
        data.draw(st.lists(st.integers(-30, 10), min_size=rows, max_size=rows))
    ).float()
    weight = grid * torch.exp2(exponents)[:, None]
    assert torch.equal(quantize(weight, "fp8").dequantize(), weight)
    noisy = torch.randn(rows, cols, generator=generator)
    qt = quantize(noisy, "fp8")
    error = (qt.dequantize() - noisy).abs()
    # 3 mantissa bits: relative error <= 2^-4 for normals, absolute <= 2^-10 x scale for subnormals
    assert bool((error <= torch.maximum(noisy.abs() * 2**-4, qt.scale * 2**-10) * (1 + 1e-6)).all())


@FAST
@given(st.data())
def test_mxfp4_representable_blocks_round_trip_exactly(data):
    rows = data.draw(st.integers(1, 4))
    blocks = data.draw(st.integers(1, 3))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    values = torch.tensor(FP4_E2M1_VALUES)[
        torch.randint(0, 16, (rows, blocks, 32), generator=generator)
    ]
    values[..., 3] = 0.5  # at least one non-zero per block
    exponents = torch.randint(-30, 30, (rows, blocks, 1), generator=generator).float()
    weight = (values * torch.exp2(exponents)).flatten(-2)
    assert torch.equal(quantize(weight, "mxfp4").dequantize(), weight)


def test_mxfp4_shared_exponent_is_exact_just_below_a_power_of_two():
    # fp32 0.25 - 1 ulp: log2 rounds to -2.0, but floor(log2) is -3, so the OCP MX shared exponent
    # is
    # -3 - emax(E2M1) = -5: E8M0 code 127 - 5 = 122 (X = 2^-5), not 123 (bf16 weights cannot hit
    # this)
    just_below = torch.nextafter(torch.tensor(0.25), torch.tensor(0.0))
    weight = torch.zeros(1, 32)
    weight[0, 5] = just_below
    qt = quantize(weight, "mxfp4")
    assert int(qt.scale[0, 0]) == 122
    assert float(formats.e8m0_to_float(qt.scale)[0, 0]) == 2.0**-5


@FAST
@given(st.integers(-100, 100), st.integers(1, 64))
def test_mxfp4_shared_exponent_matches_the_exact_floor_log2(power, ulps_below):
    # a block maximum a few fp32 ulps below 2^power has floor(log2) = power - 1
    value = torch.tensor(2.0**power, dtype=torch.float32)
    for _ in range(ulps_below):
        value = torch.nextafter(value, torch.tensor(0.0))
    weight = torch.zeros(1, 32)
    weight[0, 0] = -value
    code = int(quantize(weight, "mxfp4").scale[0, 0])
    assert code == max(0, min(254, formats.E8M0_BIAS + (power - 1) - 2))


@FAST
@given(st.data())
def test_nvfp4_representable_blocks_round_trip_exactly(data):
    rows = data.draw(st.integers(1, 4))
    blocks = data.draw(st.integers(1, 4))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    values = torch.tensor(FP4_E2M1_VALUES)[
        torch.randint(0, 16, (rows, blocks, 16), generator=generator)
    ]
    values[..., 0] = 6.0  # each block reaches the top code, so its e4m3 scale is recovered exactly
    block_scales = (
        (torch.rand(rows, blocks, 1, generator=generator) * 400 + 1).to(torch.float8_e4m3fn).float()
    )
    block_scales[0, 0] = E4M3_MAX  # the tensor's largest element is 6 x 448 x 2^k: global scale 2^k
    k = data.draw(st.integers(-20, 5))
    weight = (values * block_scales).flatten(-2) * 2.0**k
    qt = quantize(weight, "nvfp4")
    assert float(qt.global_scale) == 2.0**k
    assert torch.equal(qt.dequantize(), weight)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_error_bound_on_gaussian_weights(fmt):
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(2))
    qt = quantize(weight, fmt)
    blocks = qt.format.block_size
    if fmt == "mxfp4":
        # top binade step is 2 x scale; saturation adds up to 2 x scale
        step = formats.e8m0_to_float(qt.scale)
        bound = 2 * step
    else:
        step = qt.scale.float() * qt.global_scale
        bound = (
            step  # half the top step (2 x scale); e4m3 rounding of the block scale adds < 6 x 2^-4
        )
    error = (qt.dequantize() - weight).abs().unflatten(-1, (-1, blocks))
    assert bool((error <= bound.unsqueeze(-1) * (1 + 1e-6)).all())
    assert 0.05 < formats.quantization_error(weight, qt)["rel_error"] < 0.15


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_zero_rows_outliers_and_non_divisible_shapes(fmt):
    weight = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    weight[2] = 0.0
    weight[4, 7] = 1e5
    qt = quantize(weight, fmt, name="blk.0.ffn")
    restored = qt.dequantize()
    assert restored.shape == (5, 50) and bool(torch.isfinite(restored).all())
    assert torch.equal(restored[2], torch.zeros(50))
    assert restored[4, 7] == pytest.approx(1e5, rel=0.02)
    # fp4 pads 50 -> 64 (mxfp4) / 64 (nvfp4) with zeros: stored and counted, cut off on dequantize
    assert qt.nbytes == memory.tensor_bytes((5, 50), fmt)
    if qt.format.block_size:
        padded_codes = unpack_fp4_codes(qt.data)[:, 50:]
        assert padded_codes.shape[-1] == 14 and int(padded_codes.sum()) == 0
    assert torch.equal(quantize(torch.zeros(3, 32), fmt).dequantize(), torch.zeros(3, 32))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_rejected_with_the_tensor_name(fmt, bad):
    weight = torch.randn(3, 8, 64)
    weight[1, 4, 9] = bad
    with pytest.raises(
        ValueError,
        match=r"'layers\.3\.experts\.down_proj' holds non-finite values.*row 12, column 9",
    ):
        quantize(weight, fmt, name="layers.3.experts.down_proj")
    if fmt == "int8":
        with pytest.raises(ValueError, match="'lm_head.weight' holds"):
            quantize_int8_per_channel(weight[1], name="lm_head.weight")


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(list(FORMATS)), st.integers(1, 3), st.integers(1, 9), st.integers(1, 80))
def test_stored_bytes_equal_the_planner_formula(fmt, experts, rows, cols):
    qt = quantize(torch.randn(experts, rows, cols), fmt)
    assert qt.nbytes == memory.tensor_bytes((experts, rows, cols), fmt)
    assert qt[0].nbytes == memory.tensor_bytes((rows, cols), fmt)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_chunking_does_not_change_the_result(fmt, monkeypatch):
    weight = torch.randn(3, 16, 64, dtype=torch.bfloat16)
    whole = quantize(weight, fmt)
    monkeypatch.setattr(formats, "CHUNK_ELEMENTS", 5 * 64)
    chunked = quantize(weight, fmt)
    assert torch.equal(whole.data, chunked.data)
    assert torch.equal(whole.scale.view(torch.uint8), chunked.scale.view(torch.uint8))
    for e in range(3):  # per expert = per matrix: the NVFP4 global scale of each expert is its own
        single = quantize(weight[e], fmt)
        assert torch.equal(single.dequantize(), whole[e].dequantize())


def test_quantize_leaves_an_fp32_input_untouched():
    weight = torch.randn(4, 32)
    before = weight.clone()
    for fmt in FORMATS:
        quantize(weight, fmt)
    assert torch.equal(weight, before)


def test_unknown_format_and_bad_inputs():
    with pytest.raises(ValueError, match="'int4'.*int8, fp8, mxfp4, nvfp4"):
        quantize(torch.randn(2, 32), "int4")


# ---------------------------------------------------------------------------------------------
# Modules and schemes on a Gemma-4 model
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    from gemma_nb.tiny import random_gemma4_config, random_gemma4_model

    config = random_gemma4_config(
        vocab_size=256,
        num_hidden_layers=2,
        num_experts=8,
        top_k_experts=2,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
    )
    return random_gemma4_model(config, seed=0, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_experts_match_transformers_experts_on_dequantized_weights(tiny_model, dtype):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    source = tiny_model.model.layers[0].experts
    quantized = QuantizedExperts.from_experts(source, "int8", name="layers.0.experts")
    reference = Gemma4TextExperts(tiny_model.config).to(dtype)
    reference.config._experts_implementation = "eager"
    with torch.no_grad():
        reference.gate_up_proj.copy_(quantized.gate_up.dequantize(dtype))
        reference.down_proj.copy_(quantized.down.dequantize(dtype))
    from gemma_nb.moe import random_routing

    index, weights = random_routing(6, 8, 2, seed=4)
    hidden = torch.randn(6, 64).to(dtype)
    assert torch.equal(
        quantized(hidden, index, weights.to(dtype)), reference(hidden, index, weights.to(dtype))
    )
    assert quantized.weight_bytes == memory.tensor_bytes(
        source.gate_up_proj.shape, "int8"
    ) + memory.tensor_bytes(source.down_proj.shape, "int8")


def test_apply_scheme_int8_squeeze_replaces_groups_and_unties_the_head(tiny_model):
    model = copy.deepcopy(tiny_model)
    embedding_before = model.model.embed_tokens.weight.detach().clone()
    report = apply_scheme(model, "int8_squeeze")
    assert report["group"].tolist() == ["experts", "shared_mlp", "lm_head"]
    layers = model.model.layers
    assert all(isinstance(layer.experts, QuantizedExperts) for layer in layers)
    assert all(isinstance(layer.mlp.up_proj, Int8Linear) for layer in layers)
    # attention stays bf16 in the squeeze
    assert isinstance(layers[0].self_attn.q_proj, torch.nn.Linear)
    assert isinstance(model.lm_head, Int8Linear) and not model.config.tie_word_embeddings
    # the lookup table is untouched
    assert torch.equal(model.model.embed_tokens.weight, embedding_before)
    experts = report.set_index("group").loc["experts"]
    shapes = [(l.experts.gate_up.shape, l.experts.down.shape) for l in layers]
    assert experts["stored_bytes"] == sum(
        memory.tensor_bytes(s, "int8") for pair in shapes for s in pair
    )
    assert report.set_index("group").loc["lm_head", "stored_bytes"] == memory.tensor_bytes(
        (256, 64), "int8"
    )
    ids = torch.randint(4, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = tiny_model(input_ids=ids).logits, model(input_ids=ids).logits
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean() > 0.9
    with_bias = copy.deepcopy(tiny_model)
    with_bias.model.layers[1].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(64))


@pytest.mark.parametrize("scheme", ["bf16", "fp8_experts", "nvfp4_experts", {"attention": "mxfp4"}])
def test_apply_scheme_other_formats(tiny_model, scheme):
    model = copy.deepcopy(tiny_model)
    report = apply_scheme(model, scheme)
    ids = torch.randint(4, 256, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert bool(torch.isfinite(logits).all())
    if scheme == "bf16":
        assert report.empty
        assert torch.equal(logits, tiny_model(input_ids=ids).logits)
    else:
        assert len(report) == 1 and (report["stored_bytes"] < report["bf16_bytes"]).all()


def test_scheme_names_come_from_the_memory_planner():
    assert quant.resolve_scheme("int8_squeeze") == {
        "experts": "int8",
        "shared_mlp": "int8",
        "lm_head": "int8",
    }
    for name in memory.SCHEMES:
        quant.resolve_scheme(name)
    with pytest.raises(ValueError, match="'int4_everything'"):
        quant.resolve_scheme("int4_everything")
    with pytest.raises(ValueError, match="'fp6'"):
        quant.resolve_scheme({"experts": "fp6"})


def test_full_size_check_on_a_scaled_layer():
    from gemma_nb.moe import random_experts
    from gemma_nb.tiny import random_gemma4_config

    config = random_gemma4_config(
        hidden_size=64, num_experts=4, top_k_experts=2, moe_intermediate_size=48
    )
    experts = random_experts(config, seed=0, per_expert=True)
    table, seconds = quant.full_size_experts_check(experts, formats=("int8", "nvfp4"), top_k=2)
    assert table["equal"].all() and list(seconds.index) == ["int8", "nvfp4"]
    assert list(seconds.columns) == ["quantize_s", "dequantize_s"] and (seconds > 0).all().all()
    layer = table[table["tensor"] == "layer"].set_index("format")
    assert layer.loc["int8", "rel_error_output"] < layer.loc["nvfp4", "rel_error_output"] < 0.3


def test_a_sharded_head_quantizes_its_rows_per_rank_and_computes_the_same_logits(tiny_model):
    replicated, sharded = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    one = apply_scheme(replicated, {"lm_head": "int8"}, tp=2)  # a mapping never shards
    two = apply_scheme(sharded, "int8_experts_lm_head", tp=2)
    assert isinstance(replicated.lm_head, Int8Linear)
    shards = sharded.lm_head.shards
    assert [s.out_features for s in shards] == [128, 128]
    assert all(isinstance(s, Int8Linear) for s in shards)
    assert (
        sharded.lm_head.nbytes
        == replicated.lm_head.nbytes
        == memory.tensor_bytes((256, 64), "int8")
    )
    assert two.set_index("group").loc["lm_head"].equals(one.set_index("group").loc["lm_head"])
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sharded.lm_head(hidden), replicated.lm_head(hidden))
    single = copy.deepcopy(tiny_model)
    apply_scheme(single, "int8_experts_lm_head")  # tp=1: one shard, the plain int8 head
    assert isinstance(single.lm_head, Int8Linear)


# ---------------------------------------------------------------------------------------------
# Neuron: import-guarded, never run here
# ---------------------------------------------------------------------------------------------


def test_neuron_quant_module_imports_without_the_sdk_and_says_what_is_missing():
    from gemma_nb.neuron import quantized_dtypes as neuron_quant
    from gemma_nb.neuron.sdk import check_sdk
    from gemma_nb.targets import TargetError

    table = neuron_quant.support_matrix_table()
    assert table["dtype"].tolist() == ["INT8", "F8E4M3", "F8E5M2", "F4E2M1FN_X4"]
    status = table.set_index("dtype")["inference_on_inf2"]
    assert (
        status["INT8"] == status["F8E4M3"] == "supported" and status["F4E2M1FN_X4"] == "not usable"
    )
    assert table["sources"].str.len().gt(0).all()
    if check_sdk().missing:
        with pytest.raises(TargetError, match="Neuron SDK"):
            neuron_quant.run_trials()


@pytest.mark.parametrize("dtype_name", ["INT8", "F8E4M3", "F4E2M1FN_X4"])
def test_neuron_trial_weights_are_built_in_nxd_layouts(dtype_name):
    from gemma_nb.neuron.quantized_dtypes import trial_weights

    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(5)) * 0.02
    state, dequantized = trial_weights(dtype_name, weight)
    expected = {
        "INT8": ((16, 64), torch.int8, (16, 1), torch.float32),
        "F8E4M3": ((16, 64), torch.float8_e4m3fn, (16, 1), torch.float32),
        "F4E2M1FN_X4": ((16, 16), torch.uint16, (16, 2), torch.uint8),
    }[dtype_name]
    got = (
        tuple(state["layer.weight"].shape),
        state["layer.weight"].dtype,
        tuple(state["layer.scale"].shape),
        state["layer.scale"].dtype,
    )
    assert got == expected
    if dtype_name == "F8E4M3":
        assert float(state["layer.weight"].float().abs().max()) == 240.0  # Neuron's e4m3 range
    assert math.isclose(float((dequantized - weight).norm() / weight.norm()), 0.0, abs_tol=0.15)
