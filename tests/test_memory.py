"""The memory planner: exact parameter counts, byte formulas checked by hand, and every bad
input."""

import json
import math

import pytest
from transformers import (
    BertConfig,
    Gemma4Config,
    LlamaConfig,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    T5Config,
    ViTConfig,
)

from gemma_nb import memory, params, story
from gemma_nb.experiments import memory_arithmetic
from gemma_nb.hardware import GB, GiB
from gemma_nb.memory import GROUPS, Scheme, inventory, plan, tensor_bytes


@pytest.fixture(scope="module")
def gemma26b():
    return memory.load_gemma4_26b_config()


@pytest.fixture(scope="module")
def raw26b():
    return json.loads(params.GEMMA4_26B_CONFIG_PATH.read_text())


def counts(config):
    return inventory(config).set_index("group")["params"].to_dict()


# ----------------------------------------------------------------------------- the 26B, exactly


def test_gemma4_26b_exact_counts(gemma26b):
    inv = inventory(gemma26b).set_index("group")
    assert list(inv.index) == list(GROUPS)
    assert int(inv["params"].sum()) == 25_233_141_760
    assert inv.loc["experts", "params"] == 22_837_985_280
    assert inv.loc["shared_mlp", "params"] == 535_265_280
    assert inv.loc["attention", "params"] == 1_110_179_840
    assert inv.loc["router", "params"] == 10_901_760  # proj + scale + per_expert_scale
    assert inv.loc["norms", "params"] == 612_096  # incl. q_norm / k_norm
    assert inv.loc["embeddings", "params"] == 738_197_504
    assert inv.loc["lm_head", "params"] == 0
    assert inv.loc["per_layer_embeddings", "params"] == 0
    assert inv.loc["other", "params"] == 0
    # tied head reported, layer_scalar buffers counted apart from parameters
    assert bool(inv.loc["lm_head", "tied"]) and bool(inv.loc["embeddings", "tied"])
    assert inv.loc["other", "buffers"] == 30
    assert inv.attrs["model_class"] == "Gemma4ForCausalLM"
    assert inv.loc["experts", "share_pct"] == pytest.approx(90.5079, abs=1e-3)
    assert inv.loc["experts", "share_non_embedding_pct"] == pytest.approx(93.2355, abs=1e-3)


def test_gemma4_26b_per_group_formulas(gemma26b):
    c = gemma26b
    H, L, E, I, V = (
        c.hidden_size,
        c.num_hidden_layers,
        c.num_experts,
        c.moe_intermediate_size,
        c.vocab_size,
    )
    n_global = c.layer_types.count("full_attention")
    n_sliding = L - n_global
    sliding_attn = H * (16 * 256) * 2 + H * (8 * 256) * 2  # q, o + k, v
    global_attn = H * (16 * 512) * 2 + H * (2 * 512)  # q, o + k (k_eq_v: no v_proj)
    got = counts(c)
    assert got["experts"] == L * E * 3 * H * I
    assert got["shared_mlp"] == L * 3 * H * c.intermediate_size
    assert got["attention"] == n_sliding * sliding_attn + n_global * global_attn
    assert got["router"] == L * (E * H + H + E)
    assert got["norms"] == L * 7 * H + n_sliding * 2 * 256 + n_global * 2 * 512 + H
    assert got["embeddings"] == V * H


def test_active_params_and_summary(gemma26b):
    s = memory.param_summary(gemma26b)
    assert s["active_params"] == 25_233_141_760 - 22_837_985_280 + 22_837_985_280 * 8 // 128
    assert s["active_params_excl_embeddings"] == s["active_params"] - 738_197_504
    assert (s["num_experts"], s["top_k"], s["tied"]) == (128, 8, True)


def test_pitfalls_guarded_and_what_they_would_add(raw26b):
    base = counts(params.load_config(raw26b))
    total = sum(base.values())

    ple = dict(raw26b, hidden_size_per_layer_input=256)
    with pytest.raises(ValueError, match="hidden_size_per_layer_input=256"):
        params.check_gemma4_pitfalls(ple)
    ple_counts = counts(params.load_config(ple))
    assert sum(ple_counts.values()) - total == 2_078_231_296
    assert ple_counts["per_layer_embeddings"] == 2_078_231_296

    no_keqv = {k: v for k, v in raw26b.items() if k != "attention_k_eq_v"}
    with pytest.raises(ValueError, match="attention_k_eq_v"):
        params.check_gemma4_pitfalls(no_keqv)
    assert sum(counts(params.load_config(no_keqv)).values()) - total == 100_925_440

    for softcap in (
        {k: v for k, v in raw26b.items() if k != "final_logit_softcapping"},
        dict(raw26b, final_logit_softcapping=None),
    ):
        with pytest.raises(ValueError, match="final_logit_softcapping"):
            params.check_gemma4_pitfalls(softcap)

    missing_ple = {k: v for k, v in raw26b.items() if k != "hidden_size_per_layer_input"}
    with pytest.raises(ValueError, match="default 256"):
        params.check_gemma4_pitfalls(missing_ple)


def test_load_gemma4_26b_config_refuses_edited_file(tmp_path, raw26b):
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(dict(raw26b, hidden_size_per_layer_input=256)))
    with pytest.raises(ValueError, match="per-layer embeddings"):
        memory.load_gemma4_26b_config(path)


# ----------------------------------------------------------------------------- other families


def test_mixtral_small_matches_hand_formulas():
    L, H, I, E, V, nh, kv = 2, 64, 96, 4, 128, 4, 2
    hd = H // nh
    cfg = MixtralConfig(
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=L,
        num_attention_heads=nh,
        num_key_value_heads=kv,
        num_local_experts=E,
        num_experts_per_tok=2,
        vocab_size=V,
    )
    got = counts(cfg)
    assert got["experts"] == L * E * 3 * H * I
    assert got["router"] == L * E * H
    assert got["attention"] == L * (2 * H * nh * hd + 2 * H * kv * hd)
    assert got["norms"] == L * 2 * H + H
    assert got["embeddings"] == V * H
    assert got["lm_head"] == V * H  # untied: its own table
    assert got["shared_mlp"] == got["per_layer_embeddings"] == got["other"] == 0
    summary = memory.param_summary(cfg)
    assert summary["active_params"] == sum(got.values()) - got["experts"] + got["experts"] * 2 // E


def test_tied_mixtral_counts_head_once():
    cfg = MixtralConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=2,
        vocab_size=64,
        tie_word_embeddings=True,
    )
    inv = inventory(cfg).set_index("group")
    assert inv.loc["lm_head", "params"] == 0 and bool(inv.loc["lm_head", "tied"])
    assert inv.loc["embeddings", "params"] == 64 * 32


def test_qwen3_moe_small_with_a_dense_layer():
    L, H, I, Im, E, V, nh, kv, hd = 3, 64, 96, 32, 4, 128, 4, 2, 16
    cfg = Qwen3MoeConfig(
        hidden_size=H,
        intermediate_size=I,
        moe_intermediate_size=Im,
        num_hidden_layers=L,
        num_attention_heads=nh,
        num_key_value_heads=kv,
        head_dim=hd,
        num_experts=E,
        num_experts_per_tok=2,
        vocab_size=V,
        mlp_only_layers=[1],
    )
    got = counts(cfg)
    moe_layers = L - 1
    assert got["experts"] == moe_layers * E * 3 * H * Im
    assert got["router"] == moe_layers * E * H
    assert got["shared_mlp"] == 1 * 3 * H * I  # the dense layer's MLP
    assert got["attention"] == L * (2 * H * nh * hd + 2 * H * kv * hd)
    assert got["norms"] == L * (2 * H + 2 * hd) + H  # q_norm / k_norm are norms
    assert got["embeddings"] == got["lm_head"] == V * H


def test_qwen2_moe_shared_expert_is_shared_mlp():
    H, Im, Is, E = 64, 32, 48, 4
    cfg = Qwen2MoeConfig(
        hidden_size=H,
        intermediate_size=96,
        moe_intermediate_size=Im,
        shared_expert_intermediate_size=Is,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=E,
        num_experts_per_tok=2,
        vocab_size=128,
    )
    got = counts(cfg)
    assert got["shared_mlp"] == 3 * H * Is
    assert got["router"] == E * H + H  # gate + shared_expert_gate
    assert got["experts"] == E * 3 * H * Im


def test_dense_llama_small():
    L, H, I, V, nh, kv = 2, 64, 96, 128, 4, 2
    hd = H // nh
    cfg = LlamaConfig(
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=L,
        num_attention_heads=nh,
        num_key_value_heads=kv,
        vocab_size=V,
    )
    got = counts(cfg)
    assert got["shared_mlp"] == L * 3 * H * I
    assert got["experts"] == got["router"] == 0
    assert got["attention"] == L * (2 * H * nh * hd + 2 * H * kv * hd)
    assert memory.param_summary(cfg)["active_params"] == sum(got.values())


# ----------------------------------------------------------------------------- byte formulas


def test_tensor_bytes_by_hand():
    assert tensor_bytes((3, 40), "fp32") == 480
    assert tensor_bytes((3, 40), "bf16") == tensor_bytes((3, 40), "fp16") == 240
    assert tensor_bytes(7, "bf16") == 14
    assert tensor_bytes((3, 40), "int8") == 3 * 40 + 4 * 3
    assert tensor_bytes((3, 40), "fp8") == 3 * 40 + 4 * 3
    # MXFP4: ceil(40/32)=2 blocks -> 2*32/2 bytes of values + 2 one-byte scales per row
    assert (
        tensor_bytes((3, 40), "mxfp4")
        == math.ceil(40 / 32) * 32 // 2 * 3 + math.ceil(40 / 32) * 3
        == 102
    )
    # NVFP4: ceil(40/16)=3 blocks -> 3*16/2 + 3 per row, + one fp32 per matrix
    assert tensor_bytes((3, 40), "nvfp4") == 3 * (3 * 8 + 3) + 4 == 85
    # a stack of E matrices quantizes each one
    assert tensor_bytes((5, 3, 40), "nvfp4") == 5 * 85
    assert tensor_bytes((5, 3, 40), "int8") == 5 * (3 * 40 + 12)
    # the 26B's expert block, one layer, int8: E*(2I*H + 4*2I) + E*(H*I + 4*H)
    assert tensor_bytes((128, 1408, 2816), "int8") + tensor_bytes(
        (128, 2816, 704), "int8"
    ) == 128 * (1408 * 2816 + 4 * 1408) + 128 * (2816 * 704 + 4 * 2816)


def test_tensor_bytes_bad_input():
    with pytest.raises(ValueError, match="'int4'.*fp32, bf16, fp16, fp8, int8, mxfp4, nvfp4"):
        tensor_bytes((2, 2), "int4")


# ----------------------------------------------------------------------------- plans, by hand

L, H, I, E, V, NH, KV, HD = 2, 64, 96, 4, 128, 4, 2, 16


@pytest.fixture(scope="module")
def tiny_mixtral():
    return MixtralConfig(
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=L,
        num_attention_heads=NH,
        num_key_value_heads=KV,
        num_local_experts=E,
        num_experts_per_tok=2,
        vocab_size=V,
    )


def test_plan_int8_experts_by_hand(tiny_mixtral):
    p = plan(
        tiny_mixtral,
        tp=2,
        scheme="int8_experts",
        context_len=10,
        batch=1,
        runtime_allowance_bytes=1000,
    )
    b = {g: p.bytes(g) for g in memory.PLAN_ROWS}
    # experts int8, sharded by expert: each rank holds E/2 experts, scales per expert per row
    assert b["experts"] == L * ((E // 2) * (2 * I * H + 4 * 2 * I) + (E // 2) * (H * I + 4 * H))
    # attention bf16 sharded: q/k/v split by output rows, o by input columns
    assert b["attention"] == L * 2 * (
        NH * HD // 2 * H + 2 * (KV * HD // 2) * H + H * (NH * HD // 2)
    )
    assert b["router"] == L * E * H * 2  # replicated bf16
    assert b["norms"] == (2 * L + 1) * H * 2  # replicated bf16
    assert b["lm_head"] == V * H * 2  # replicated bf16 (untied head)
    assert (
        b["embeddings"] == 0
        and p.table.set_index("group").loc["embeddings", "host_bytes"] == V * H * 2
    )
    assert b["kv_cache"] == L * 2 * (KV // 2) * HD * 4 * 10  # fp32 K and V, 10 tokens
    assert b["runtime_allowance"] == 1000
    assert p.total_bytes == sum(b.values())


def test_sharding_halves_sharded_groups_only(tiny_mixtral):
    one = plan(tiny_mixtral, tp=1, scheme="bf16", context_len=8)
    two = plan(tiny_mixtral, tp=2, scheme="bf16", context_len=8)
    for g in ("experts", "attention", "kv_cache"):
        assert two.bytes(g) * 2 == one.bytes(g)
    for g in ("router", "norms", "lm_head", "runtime_allowance"):
        assert two.bytes(g) == one.bytes(g)
    sharded_head = plan(
        tiny_mixtral, tp=2, scheme=Scheme("head", lm_head_sharded=True), context_len=8
    )
    assert sharded_head.bytes("lm_head") * 2 == one.bytes("lm_head")


def test_row_parallel_int8_keeps_whole_scales():
    cfg = LlamaConfig(
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=1,
        num_attention_heads=NH,
        num_key_value_heads=KV,
        vocab_size=V,
    )
    p = plan(cfg, tp=2, scheme=Scheme("mlp8", dtypes={"shared_mlp": "int8"}), context_len=0)
    gate_up = 2 * ((I // 2) * H + 4 * (I // 2))  # column-parallel: rows and their scales split
    down = H * (I // 2) + 4 * H  # row-parallel: inputs split, every rank keeps all H scales
    assert p.bytes("shared_mlp") == gate_up + down


def test_replicated_groups_do_not_shrink(tiny_mixtral):
    not_sharded = Scheme("no_tp", sharded=frozenset())
    p1 = plan(tiny_mixtral, tp=1, scheme=not_sharded, context_len=0)
    p2 = plan(tiny_mixtral, tp=2, scheme=not_sharded, context_len=0)
    for g in GROUPS:
        assert p1.bytes(g) == p2.bytes(g)


def test_gemma4_26b_story_bytes(gemma26b):
    squeeze = plan(gemma26b, 2, "int8_squeeze", 512)
    first = plan(gemma26b, 2, "int8_experts", 512)
    assert first.bytes("lm_head") == 262_144 * 2816 * 2  # replicated bf16 copy of the tied table
    assert squeeze.bytes("lm_head") == 131_072 * 2816 + 4 * 131_072  # vocab-parallel int8
    assert first.bytes("experts") == 30 * (
        64 * (1408 * 2816 + 4 * 1408) + 64 * (2816 * 704 + 4 * 2816)
    )
    assert first.bytes("experts") == squeeze.bytes("experts")
    assert first.bytes("shared_mlp") == 535_265_280  # bf16 / 2 ranks
    assert squeeze.bytes("shared_mlp") == 30 * (
        2 * (1056 * 2816 + 4 * 1056) + 2816 * 1056 + 4 * 2816
    )
    assert first.bytes("kv_cache") == 2 * 112_640 * 512  # fp32 buffers
    assert (
        squeeze.bytes("runtime_allowance") == memory.DEFAULT_RUNTIME_ALLOWANCE_BYTES == 608 * 2**20
    )
    figures = memory_arithmetic.story_figures(gemma26b)
    assert figures["lm_head_released_gb_per_rank"] == pytest.approx(1.107, abs=1e-3)
    assert figures["shared_mlp_int8_saving_gb_per_rank"] == pytest.approx(0.267, abs=1e-3)
    assert figures["experts_bf16_gb"] == pytest.approx(45.676, abs=1e-3)


def test_allowance_window_reproduces_fail_then_fit(gemma26b):
    window = memory.allowance_window(gemma26b, budget_bytes=16 * GiB)
    assert window["min_to_fail_bytes"] < window["max_to_fit_bytes"]
    allowance = (window["min_to_fail_bytes"] + window["max_to_fit_bytes"]) // 2
    assert (
        plan(gemma26b, 2, "int8_experts", runtime_allowance_bytes=allowance).total_bytes > 16 * GiB
    )
    assert (
        plan(gemma26b, 2, "int8_squeeze", runtime_allowance_bytes=allowance).total_bytes <= 16 * GiB
    )


# ----------------------------------------------------------------------------- KV cache


def test_kv_cache_bytes_per_token(gemma26b):
    assert memory.kv_cache_bytes(gemma26b, tp=2, context_len=1, dtype="bf16") == 112_640
    assert memory.kv_cache_bytes(gemma26b, tp=1, context_len=1, dtype="bf16") == 225_280
    # tp=4: sliding 8 KV heads -> 2/rank; global 2 KV heads replicated -> 1/rank
    assert (
        memory.kv_cache_bytes(gemma26b, tp=4, context_len=1)
        == 25 * 2 * 2 * 256 * 2 + 5 * 2 * 1 * 512 * 2
    )
    assert memory.kv_cache_bytes(gemma26b, tp=2, context_len=512, dtype="fp32") == 2 * 112_640 * 512


def test_kv_cache_sizes_sliding_layers_for_the_whole_context(gemma26b):
    assert memory.kv_cache_bytes(gemma26b, tp=2, context_len=4096, dtype="bf16") == 112_640 * 4096


def test_valid_tp_degrees(gemma26b):
    assert memory.valid_tp_degrees(gemma26b, 32) == [1, 2, 4, 8, 16]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "config, pattern",
    [
        (
            BertConfig(
                hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
            ),
            "BertConfig \\(model_type 'bert'\\) is an encoder",
        ),
        (
            ViTConfig(
                hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
            ),
            "ViTConfig \\(model_type 'vit'\\) has no causal-LM class",
        ),
        (
            T5Config(d_model=32, num_layers=1, num_heads=2),
            "T5Config \\(model_type 't5'\\) is an encoder",
        ),
        (Gemma4Config(), "is multimodal; pass its language model's config"),
        ({"model_type": "llama"}, "config of type dict is not a transformers PretrainedConfig"),
    ],
)
def test_non_causal_lm_configs_rejected(config, pattern):
    with pytest.raises(ValueError, match=pattern):
        inventory(config)


def test_tp_errors(gemma26b, tiny_mixtral):
    with pytest.raises(
        ValueError,
        match=r"tp=3.*num_attention_heads=16.*1, 2, 4, 8, 16",
    ):
        plan(gemma26b, tp=3)
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match=rf"tp={bad!r}.*>= 1"):
            plan(gemma26b, tp=bad)
    odd_kv = LlamaConfig(
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=4,
        head_dim=8,
        vocab_size=32,
    )
    with pytest.raises(ValueError, match=r"tp=3.*num_key_value_heads=4"):
        plan(odd_kv, tp=3)
    with pytest.raises(ValueError, match=r"tp=8.*num_experts=4.*1, 2, 4"):
        plan(
            MixtralConfig(
                hidden_size=64,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=8,
                num_key_value_heads=8,
                num_local_experts=4,
                vocab_size=32,
            ),
            tp=8,
        )
    with pytest.raises(ValueError, match="tp=3"):
        memory.kv_cache_bytes(gemma26b, tp=3, context_len=1)


def test_scheme_and_context_errors(tiny_mixtral):
    with pytest.raises(ValueError, match="'int4_everything'.*bf16, int8_experts"):
        plan(tiny_mixtral, scheme="int4_everything")
    with pytest.raises(ValueError, match="'int3'"):
        Scheme("x", dtypes={"experts": "int3"})
    with pytest.raises(ValueError, match=r"context_len=-1.*>= 0"):
        plan(tiny_mixtral, context_len=-1)
    with pytest.raises(ValueError, match=r"batch=0.*>= 1"):
        plan(tiny_mixtral, batch=0)


def test_load_config_errors():
    with pytest.raises(ValueError, match="no 'model_type' key"):
        params.load_config({"hidden_size": 8})
    with pytest.raises(ValueError, match="'not_a_model'"):
        params.load_config({"model_type": "not_a_model"})
    llama = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "vocab_size": 16,
    }
    assert counts(params.load_config(llama))["shared_mlp"] == 3 * 32 * 48


def test_fit_table_and_plans_table(gemma26b):
    table = memory.fit_table(gemma26b, ["bf16", "int8_squeeze"], ["inf2.xlarge", "inf2.24xlarge"])
    xl = table[table.instance == "inf2.xlarge"].set_index("scheme")
    assert list(table["tp"]) == [2, 2, 8, 8]
    assert not xl.loc["bf16", "fits"] and xl.loc["int8_squeeze", "fits"]
    assert xl.loc["int8_squeeze", "headroom_gb"] == pytest.approx(
        16 * GiB / GB - plan(gemma26b).total_gb
    )
    wide = memory.plans_table([plan(gemma26b, 2, s) for s in ("bf16", "int8_squeeze")])
    assert wide.loc["total", "int8_squeeze"] == pytest.approx(plan(gemma26b).total_gb)


def test_allowance_window_short_by_what_if(gemma26b):
    window = memory.allowance_window(gemma26b, budget_bytes=16 * GB, short_by_bytes=3 * GB)
    allowance = window["allowance_if_short_by_bytes"]
    assert (
        plan(gemma26b, 2, "int8_experts", runtime_allowance_bytes=allowance).total_bytes == 19 * GB
    )
    squeeze = plan(gemma26b, 2, "int8_squeeze", runtime_allowance_bytes=allowance).total_bytes
    assert window["fitting_overflow_then_bytes"] == squeeze - 16 * GB


def test_claim_range_and_agreement(gemma26b):
    assert story.get_claim("experts_bf16_gb").within == (45.5, 45.7)  # "45.6 GB": its last decimal
    assert story.get_claim("lm_head_bf16_gb_per_rank").within == (1.47, 1.49)
    assert story.get_claim("int8_experts_gap_gb").within == (3.0, 4.0)  # quoted as "~3-4 GB"
    # quoted as "~12-13 GB"
    assert story.get_claim("final_residency_gb_per_rank").within == (
        12.0,
        13.0,
    )
    figures = memory_arithmetic.story_figures(gemma26b)
    for key in (
        "total_params_b",
        "experts_bf16_gb",
        "experts_int8_gb_per_rank",
        "experts_share_pct",
        "lm_head_released_gb_per_rank",
        "shared_mlp_int8_saving_gb_per_rank",
    ):
        assert story.agrees_with_claim(key, figures[key]), key
    # it fits on paper
    assert not story.agrees_with_claim("int8_experts_gap_gb", figures["int8_experts_gap_gb"])
    # the "3-4 GB" holds only read as what sits in HBM beside the experts
    readings = memory_arithmetic.gap_readings(gemma26b).set_index("reading")
    assert readings["inside_claim"].tolist() == [True, False, False]
    assert readings["computed_gb"].iloc[0] == pytest.approx(
        figures["int8_experts_non_expert_gb"], rel=1e-12
    )
    assert readings["computed_gb"].iloc[1] == pytest.approx(
        figures["int8_experts_gap_gb"], rel=1e-12
    )
    window = memory_arithmetic.allowance_table(gemma26b, words=False)
    assert window.loc["min_to_fail_gb", "spec"] == pytest.approx(2.468224964, abs=1e-9)
    assert window.loc["allowance_if_short_by_gb", "story"] == pytest.approx(
        16.0 + 3.5 - window.loc["failing_static_gb", "story"]
    )
    assert memory_arithmetic.allowance_table(gemma26b).columns.tolist() == [
        "16 GB core (the story)",
        "16 GiB core (AWS)",
    ]
    assert not story.agrees_with_claim(
        "final_residency_gb_per_rank", figures["final_residency_gb_per_rank"]
    )
    assert story.agrees_with_claim(
        "final_residency_gb_per_rank", figures["final_residency_gb_per_rank"] * GB / GiB
    )
    with pytest.raises(ValueError, match="'not_a_claim'.*gemma_nb.story.CLAIMS"):
        story.get_claim("not_a_claim").within
