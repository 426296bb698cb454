"""The cpu stand-ins of neuronx-distributed keep the SDK's contracts, and the neuron build passes
ModelBuilder's checkpoint path with them."""

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gemma_nb.neuron import build as B  # noqa: E402
from gemma_nb.neuron.quantized_dtypes import patch_scale_dequantize, scale_dequantize  # noqa: E402
from gemma_nb.rehearsal import emulate as E  # noqa: E402
from gemma_nb.rehearsal import standins as S  # noqa: E402
from gemma_nb.tiny import random_gemma4_config, random_gemma4_model  # noqa: E402

# Heads, KV heads (4 sliding, 2 global) and experts that split at TP=2, at toy size.
TP2_DIMS = dict(
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_global_key_value_heads=2,
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=32,
    vocab_size=512,
)


@pytest.fixture(scope="module")
def tp2_model():
    model = random_gemma4_model(random_gemma4_config(**TP2_DIMS), seed=5, dtype=torch.float32)
    checkpoint = B.convert_checkpoint(model.state_dict(), model.config, dtype=torch.float32)
    return model, checkpoint


def _build(tp: int, dtype: str = "float32") -> B.NeuronBuildConfig:
    return B.NeuronBuildConfig(
        model_dir="unused", output_dir="unused", max_len=24, bucket=8, tp_degree=tp, dtype=dtype
    )


def test_layers_carry_nxd_tags_shapes_and_dtypes_at_tp2():
    sdk = S.cpu_sdk()
    with S.model_parallel(2, rank=1):
        column = sdk.ColumnParallelLinear(16, 32, bias=False, gather_output=False)
        row = sdk.RowParallelLinear(32, 16, bias=False, input_is_parallel=True)
        qcol = sdk.QuantizedColumnParallel(
            16,
            32,
            bias=False,
            gather_output=True,
            dtype=torch.bfloat16,
            quantization_type=sdk.QuantizationType.PER_CHANNEL_SYMMETRIC,
            quantization_per_channel_axis=0,
        )
        qrow = sdk.QuantizedRowParallel(
            32,
            16,
            bias=False,
            input_is_parallel=True,
            quantization_type=sdk.QuantizationType.PER_CHANNEL_SYMMETRIC,
        )
    tags = lambda p: (p.tensor_model_parallel, p.partition_dim, p.partition_stride)  # noqa: E731
    assert column.weight.shape == (16, 16) and tags(column.weight) == (True, 0, 1)
    assert row.weight.shape == (16, 16) and tags(row.weight) == (True, 1, 1)
    assert (
        qcol.weight.dtype == torch.int8
        and qcol.weight.shape == (16, 16)
        and tags(qcol.weight) == (True, 0, 1)
    )
    assert (
        qcol.scale.dtype == torch.float32
        and qcol.scale.shape == (16, 1)
        and tags(qcol.scale) == (True, 0, 1)
    )
    assert qrow.weight.shape == (16, 16) and tags(qrow.weight) == (True, 1, 1)
    assert qrow.scale.shape == (16, 1) and qrow.scale.tensor_model_parallel is False  # replicated
    with pytest.raises(RuntimeError, match="parallel state"):
        sdk.ColumnParallelLinear(16, 32, bias=False)
    with S.model_parallel(2), pytest.raises(TypeError, match=r"implement \['bias'\]"):
        sdk.QuantizedColumnParallel(16, 32)  # NxD's default bias=True: not kept by the stand-in
    with S.model_parallel(2), pytest.raises(TypeError, match=r"implement \['bias'\]"):
        # nor by the plain layers: the port builds every layer without one
        sdk.RowParallelLinear(16, 32)
    with S.model_parallel(2), pytest.raises(TypeError, match="input_is_parallel=True only"):
        # NxD's default scatters the input; the port feeds it shards
        sdk.QuantizedRowParallel(32, 16, bias=False)
    with pytest.raises(ValueError, match="output_size=30.*tp=4"):
        with S.model_parallel(4):
            sdk.ColumnParallelLinear(16, 30, bias=False)


def test_shard_checkpoint_cuts_by_the_tags_and_names_a_mismatch():
    sdk = S.cpu_sdk()

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = sdk.ColumnParallelLinear(4, 6, bias=False, gather_output=False, stride=3)
            self.down = sdk.QuantizedRowParallel(
                6,
                4,
                bias=False,
                input_is_parallel=True,
                quantization_type=sdk.QuantizationType.PER_CHANNEL_SYMMETRIC,
            )
            self.norm = torch.nn.LayerNorm(4)

    full = {
        "up.weight": torch.arange(24.0).reshape(6, 4),
        "down.weight": torch.arange(24, dtype=torch.int8).reshape(4, 6),
        "down.scale": torch.ones(4, 1, dtype=torch.float64),
        "norm.weight": torch.ones(4),
        "extra": torch.ones(1),
    }
    with S.model_parallel(2), S.init_on_meta():
        module = Two()
    assert module.up.weight.is_meta and module.up.weight.partition_stride == 3
    shard = S.shard_checkpoint(module, full, rank=1, tp=2)
    assert "extra" not in shard and torch.equal(shard["norm.weight"], full["norm.weight"])
    # stride 3: every other chunk of 1 row
    assert torch.equal(shard["up.weight"], full["up.weight"][[1, 3, 5]])
    assert torch.equal(shard["down.weight"], full["down.weight"][:, 3:])
    # cast, replicated
    assert shard["down.scale"].dtype == torch.float32 and shard["down.scale"].shape == (
        4,
        1,
    )
    with pytest.raises(
        RuntimeError,
        match=r"torch.Size\(\[4, 3\]\) for down.weight.*torch.Size\(\[4, 4\]\)",
    ):
        S.shard_checkpoint(
            module, dict(full, **{"down.weight": torch.zeros(4, 8, dtype=torch.int8)}), 0, 2
        )


def test_meta_built_module_loads_every_ranks_shard(tp2_model):
    """The test that would have caught defect 1: NeuronGemma4 built on meta as ModelBuilder builds
    it, sharded by the emulated shard_children, every rank's shard fits, the NxD tags and fp32
    scales survive _materialize, and each rank's KV state holds half the heads."""
    model, checkpoint = tp2_model
    build = _build(2, "bfloat16")
    sdk = S.cpu_sdk()
    with S.model_parallel(2), S.init_on_meta():
        skeleton = B.NeuronGemma4(model.config, build, parallel=True, sdk=sdk)
    scale = skeleton.lm.model.layers[0].mlp.gate_proj.scale
    assert scale.is_meta and scale.dtype == torch.float32 and scale.tensor_model_parallel
    for rank in range(2):
        shard = S.shard_checkpoint(skeleton, checkpoint, rank, 2)
        # 2 of 4 KV heads
        assert shard["lm.model.layers.0.self_attn.k_proj.weight"].shape == (
            2 * 32,
            128,
        )
        module = E.rank_module(model.config, _build(2), checkpoint, model.state_dict(), rank, sdk)
        # 4 -> 2 sliding, 2 -> 1 global (TP2_DIMS)
        assert [c.shape[1] for c in module.k_cache] == [
            2,
            1,
        ]
    # What _materialize did before the fix: plain parameters, tags and fp32 scale lost -> whole
    # tensors kept.
    for module in skeleton.modules():
        for name, tensor in list(module._parameters.items()):
            if tensor is not None and tensor.is_meta:
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(tensor.shape, dtype=torch.bfloat16), requires_grad=False
                )
    with pytest.raises(RuntimeError, match="expected shape .* but found"):
        S.shard_checkpoint(skeleton, checkpoint, 0, 2)


def test_scale_dequantize_patch_fits_2d_and_3d_like_the_sdk():
    scale = torch.rand(6, 1) + 0.5  # a layer's per-channel scale [out, 1]; the layers pass scale.T
    out_3d = torch.randn(1, 5, 6, dtype=torch.bfloat16)
    out_2d = out_3d[0]
    sdk_3d = S.sdk_scale_dequantize(out_3d.clone(), scale.T, torch.bfloat16)
    assert torch.equal(scale_dequantize(out_3d, scale.T, torch.bfloat16), sdk_3d)
    with pytest.raises(RuntimeError, match="broadcast shape"):
        S.sdk_scale_dequantize(out_2d.clone(), scale.T, torch.bfloat16)
    assert torch.equal(scale_dequantize(out_2d, scale.T, torch.bfloat16), sdk_3d[0])
    sdk = S.cpu_sdk()
    patch_scale_dequantize(sdk.quantization_layers)
    assert sdk.quantization_layers.scale_dequantize is scale_dequantize
    # others untouched
    assert S.cpu_sdk().quantization_layers.scale_dequantize is S.sdk_scale_dequantize


def test_masks_are_finite_in_bf16_and_a_masked_row_has_no_nan(tp2_model):
    model, _ = tp2_model
    inputs = B.step_inputs(torch.zeros(1, 8, 128), list(range(8)), max_len=24, sliding_window=4)
    for tensor in inputs:
        if tensor.is_floating_point():
            assert torch.isfinite(tensor.to(torch.bfloat16)).all()
    scores = torch.randn(1, 24).to(torch.bfloat16) * 10  # one query's scores, every key masked
    masked = scores + torch.full((1, 24), B.MASK_MIN, dtype=torch.bfloat16)
    assert torch.isfinite(masked).all() and not torch.softmax(masked.float(), -1).isnan().any()
    fp32_min = torch.full((1, 24), torch.finfo(torch.float32).min).to(torch.bfloat16)
    assert torch.softmax((scores + fp32_min).float(), -1).isnan().all()  # why the old mask failed


def test_single_rank_graph_without_a_group_has_its_shard_shapes(tp2_model):
    """group=None at tp=2: one rank's shapes, collectives as identities (for lowering one rank's
    graph)."""
    model, checkpoint = tp2_model
    module = E.rank_module(
        model.config, _build(2), checkpoint, model.state_dict(), 1, S.cpu_sdk(), experts="sparse"
    )
    inputs = B.step_inputs(torch.randn(1, 1, 128), [0], 24, model.config.sliding_window)
    with torch.no_grad():
        logits, *state = module(*inputs)
    # this rank's half of the vocab: no all-gather without a group
    assert logits.shape == (
        1,
        1,
        256,
    )
    assert [s.shape[1] for s in state] == [2, 1, 2, 1]


def test_one_artifact_per_decode_path_both_with_the_same_flags():
    build = _build(2)
    assert build.graph_keys() == {"prefill": "dense", "decode_dense": "dense"}
    assert build.routed_graphs() == {"prefill": "prefill", "decode": "decode_dense"}
    sparse = B.NeuronBuildConfig(model_dir="m", output_dir="o", decode_experts="sparse")
    assert sparse.graph_keys() == {"prefill": "dense", "decode_sparse": "sparse"}
    assert sparse.routed_graphs() == {"prefill": "prefill", "decode": "decode_sparse"}
    # NxD's default (no warning) for both: the dense/sparse ratio is the experts' alone
    assert (
        build.compiler_args
        == sparse.compiler_args
        == "--model-type transformer --auto-cast=none -O1"
    )
    # what only the compile box keeps, under the one folder rsync leaves behind
    assert (
        Path(sparse.compiler_workdir).parent == sparse.scratch_dir() == Path("o/compiler_workdir")
    )
    with pytest.raises(
        ValueError,
        match="decode_experts='both'.*dense, sparse",
    ):
        B.NeuronBuildConfig(model_dir="m", output_dir="o", decode_experts="both")


def test_graph_inputs_are_int32_like_nxd_inference_traces_them():
    inputs = B.step_inputs(torch.zeros(1, 3, 8), [0, 1, 2], max_len=8, sliding_window=4)
    assert [t.dtype for t in inputs] == [
        torch.float32,
        torch.int32,
        torch.float32,
        torch.float32,
        torch.int32,
    ]


# --------------------------------------------------------------------------------------------
# Where NxD refuses, the stand-ins refuse too
# --------------------------------------------------------------------------------------------
def _int8(sdk, **kwargs):
    return dict(bias=False, quantization_type=sdk.QuantizationType.PER_CHANNEL_SYMMETRIC, **kwargs)


def test_a_quantized_layer_missing_from_the_checkpoint_is_an_error_not_garbage():
    sdk = S.cpu_sdk()
    with S.model_parallel(2), S.init_on_meta():
        layer = torch.nn.ModuleDict(
            {
                "down": sdk.QuantizedRowParallel(8, 4, input_is_parallel=True, **_int8(sdk)),
                "up": sdk.ColumnParallelLinear(4, 8, bias=False, gather_output=False),
            }
        )
    full = {"down.weight": torch.zeros(4, 8, dtype=torch.int8), "down.scale": torch.ones(4, 1)}
    # a plain layer's missing key is skipped
    assert set(S.shard_checkpoint(layer, full, 0, 2)) == set(full)
    with pytest.raises(RuntimeError, match=r"down\.scale"):
        S.shard_checkpoint(layer, {"down.weight": full["down.weight"]}, 0, 2)
    with pytest.raises(RuntimeError, match=r"down\.weight"):
        S.shard_checkpoint(layer, {"down.scale": full["down.scale"]}, 0, 2)


def test_rank_ordering_picks_the_shard_and_must_name_every_rank():
    sdk = S.cpu_sdk()
    with S.model_parallel(2), S.init_on_meta():
        layer = sdk.QuantizedColumnParallel(
            4, 8, gather_output=False, rank_ordering=[1, 0], **_int8(sdk)
        )
    assert layer.weight.rank_ordering == [1, 0] and layer.scale.rank_ordering == [1, 0]
    full = {
        "weight": torch.arange(32, dtype=torch.int8).view(8, 4),
        "scale": torch.arange(8.0).view(8, 1),
    }
    shard = S.shard_checkpoint(layer, full, 0, 2)
    assert torch.equal(shard["weight"], full["weight"][4:]) and torch.equal(
        shard["scale"], full["scale"][4:]
    )
    with S.model_parallel(2), pytest.raises(ValueError, match=r"ranks 0...2"):
        sdk.QuantizedColumnParallel(4, 8, gather_output=False, rank_ordering=[0, 0], **_int8(sdk))


def test_quantized_layers_keep_nxd_s_dtypes_axes_and_padding_checks():
    sdk = S.cpu_sdk()
    with S.model_parallel(2):
        column = sdk.QuantizedColumnParallel(
            4, 7, gather_output=True, dtype=torch.bfloat16, pad=True, **_int8(sdk)
        )
        tensor_wise = sdk.QuantizedRowParallel(8, 4, input_is_parallel=True, bias=False)
        experts = sdk.QuantizedExpertFusedColumnParallel(
            6,
            4,
            10,
            stride=2,
            is_fused_gate_up=True,
            quantization_type=sdk.QuantizationType.EXPERT_WISE_PER_CHANNEL_SYMMETRIC,
        )
        shared = sdk.QuantizedExpertFusedRowParallel(
            6, 8, 4, quantization_type=sdk.QuantizationType.PER_CHANNEL_SYMMETRIC
        )
        with pytest.raises(TypeError, match=r"implement \['reduce_output'\]"):
            # the port all-reduces the partials itself
            sdk.QuantizedExpertFusedRowParallel(6, 8, 4, reduce_output=True)
        with pytest.raises(NotImplementedError, match="F4E2M1FN_X4"):
            sdk.QuantizedColumnParallel(
                4, 8, quantized_dtype=sdk.QuantizedDtype.F4E2M1FN_X4, **_int8(sdk)
            )
    assert (
        column.dequantized_dtype == torch.bfloat16
        and column.scale.shape == (4, 1)
        and column.weight.shape == (4, 4)
    )
    assert tensor_wise.scale.shape == (1,) and tensor_wise.scale.tensor_model_parallel is False
    assert experts.weight.shape == (6, 4, 5) and experts.scale.shape == (6, 1, 5)
    assert (experts.weight.partition_dim, experts.weight.partition_stride) == (2, 2)
    assert (experts.scale.tensor_model_parallel, experts.scale.partition_stride) == (True, 2)
    assert shared.weight.shape == (6, 4, 4) and shared.scale.shape == (1, 1, 4)
    with pytest.raises(RuntimeError, match=r"size 6 expected 5"):
        column.preshard_hook(
            {"weight": torch.zeros(6, 4, dtype=torch.int8), "scale": torch.ones(6, 1)}, "weight"
        )
    # plain per-channel expert scales [1, 1, out] are shared by the experts: indexing them by expert
    # fails on the cpu as in NxD's cpu mode (an XLA gather would clamp the index to 0 on the device)
    with pytest.raises(IndexError):
        shared(torch.zeros(2, 1, 1, 4), expert_indices=torch.tensor([3, 5]))


def test_init_on_device_without_force_breaks_int8_weights_as_nxd_documents():
    sdk = S.cpu_sdk()
    with (
        S.model_parallel(2),
        S.init_on_device(torch.device("meta"), force_custom_init_on_device=True),
    ):
        head = sdk.QuantizedColumnParallel(4, 8, **_int8(sdk))
    assert head.weight.is_meta and head.weight.requires_grad is False
    with S.model_parallel(2), S.init_on_device(torch.device("meta")):
        with pytest.raises(RuntimeError, match="floating point"):
            sdk.QuantizedColumnParallel(4, 8, **_int8(sdk))
