"""gemma_nb.tiny: the bundled checkpoint (loaded from disk, never retrained) and random Gemma-4
configs."""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma4ForCausalLM

from gemma_nb.evaluate import compare_logits, fact_recall, greedy_generate
from gemma_nb.modelio import load_model
from gemma_nb.tiny import (
    BUNDLED_ID,
    CHECKPOINT_DIR,
    FACTS,
    TINY_DIMS,
    default_layer_types,
    fact_prompts,
    random_gemma4_config,
    random_gemma4_model,
)
from gemma_nb.tiny.corpus import COUNTRIES, build_tokenizer

FULL_LAYER = dict(
    hidden_size=2816,
    intermediate_size=2112,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    global_head_dim=512,
    num_global_key_value_heads=2,
    num_experts=128,
    top_k_experts=8,
    moe_intermediate_size=704,
    vocab_size=262144,
)
CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "training_args.json",
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT_DIR).eval()
    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINT_DIR)
    return model, tokenizer


# --- the corpus ---------------------------------------------------------------------------


def test_corpus_has_150_plus_capitals_and_paris():
    capitals = [f for f in FACTS if f.kind == "capital"]
    assert len(capitals) == len(COUNTRIES) >= 150
    assert ("The capital of France is", "Paris .") in {(f.prompt, f.answer) for f in capitals}
    assert {f.kind for f in FACTS} == {"capital", "continent", "currency", "language"}
    prompts = fact_prompts()
    assert len(prompts) == len(set(prompts)) == len(FACTS)  # one answer per prompt


def test_the_held_out_split_is_true_new_text_in_the_corpus_words():
    from gemma_nb.tiny.corpus import COUNTRIES, FACTS, HELD_OUT, build_tokenizer

    tokenizer = build_tokenizer()
    trained = {fact.sentence for fact in FACTS}
    continent = {capital: continent for _, capital, continent in COUNTRIES}
    assert len(HELD_OUT) == sum(capital != country for country, capital, _ in COUNTRIES) == 179
    assert HELD_OUT[0].sentence == "Tirana is in Europe ."
    for fact in HELD_OUT:
        assert fact.sentence not in trained and fact.answer == f"{continent[fact.subject]} ."
        assert tokenizer.unk_token_id not in tokenizer(fact.sentence).input_ids
    # the checkpoints trained on FACTS only: not one prompt of the split opens a trained sentence
    assert not {fact.prompt for fact in HELD_OUT} & {fact.prompt for fact in FACTS}


def test_tokenizer_covers_the_corpus_and_adds_bos():
    tokenizer = build_tokenizer()
    for fact in FACTS:
        ids = tokenizer(fact.sentence).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == fact.sentence
    assert [tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id] == [0, 1, 2]


# --- the bundled checkpoint ---------------------------------------------------------------


def test_checkpoint_files_and_size():
    folder = CHECKPOINT_DIR
    for name in CHECKPOINT_FILES:
        assert (folder / name).is_file(), name
    size_mb = sum(p.stat().st_size for p in folder.iterdir()) / 1e6
    print(f"bundled checkpoint: {size_mb:.1f} MB")
    assert size_mb <= 20
    assert not list(folder.glob("*.bin"))


def test_checkpoint_has_the_26b_architecture(tiny):
    model, tokenizer = tiny
    config = model.config
    assert isinstance(model, Gemma4ForCausalLM)
    assert config.enable_moe_block and config.attention_k_eq_v and config.tie_word_embeddings
    assert config.hidden_size_per_layer_input == 0 and config.num_kv_shared_layers == 0
    assert not config.use_double_wide_mlp
    assert config.final_logit_softcapping == 30.0
    assert config.hidden_activation == "gelu_pytorch_tanh"
    assert config.num_experts / config.top_k_experts == 128 / 8  # the 26B's active ratio
    assert (config.num_experts, config.top_k_experts) == (32, 2)
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert config.vocab_size == len(tokenizer)
    assert config.rope_parameters["full_attention"]["partial_rotary_factor"] == 0.25
    full = config.layer_types.index("full_attention")
    assert model.model.layers[full].self_attn.v_proj is None  # K = V on global layers
    assert model.model.layers[full].self_attn.head_dim == TINY_DIMS["global_head_dim"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for layer in model.model.layers:
        assert hasattr(layer, "mlp") and hasattr(layer, "experts") and hasattr(layer, "router")
    assert not hasattr(model.model, "embed_tokens_per_layer")


def test_paris(tiny):
    model, tokenizer = tiny
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = greedy_generate(model, prompt, 2)
    assert tokenizer.decode(out[0, prompt.shape[1] :]) == "Paris ."
    # transformers' own generate agrees
    generated = model.generate(prompt, max_new_tokens=2, do_sample=False)
    assert tokenizer.decode(generated[0, prompt.shape[1] :], skip_special_tokens=True) == "Paris ."


def test_fact_recall_at_least_95_percent(tiny):
    model, tokenizer = tiny
    accuracy, table = fact_recall(model, tokenizer, FACTS)
    print(f"fact recall fp32: {accuracy:.3f} over {len(table)} facts")
    assert len(table) == len(FACTS)
    assert accuracy >= 0.95
    recorded = json.loads((CHECKPOINT_DIR / "training_args.json").read_text())
    assert recorded["final_recall_fp32"] == pytest.approx(accuracy, abs=1e-4)
    assert recorded["command"].startswith("python -m gemma_nb.tiny train")


def test_embeddings_are_trained_and_the_scale_matters(tiny):
    """Skipping the sqrt(hidden) embedding scale on the host must give wrong answers, not a
    nudge."""
    model, tokenizer = tiny
    table = model.get_input_embeddings().weight.detach()
    scale = model.get_input_embeddings().embed_scale
    assert float(scale) == pytest.approx(TINY_DIMS["hidden_size"] ** 0.5)
    init_std = model.config.initializer_range
    assert float(table.std()) > 2 * init_std  # grew well away from the random init

    def scaled(ids):
        return model(inputs_embeds=table[ids] * scale.to(table.dtype)).logits

    def unscaled(ids):
        return model(inputs_embeds=table[ids]).logits

    prompts = [f.prompt for f in FACTS]
    assert compare_logits(model, scaled, prompts, tokenizer=tokenizer)["max_abs_diff"] == 0.0
    wrong = compare_logits(model, unscaled, prompts, tokenizer=tokenizer)
    capitals = [f for f in FACTS if f.kind == "capital"]
    capital_recall, table_unscaled = fact_recall(unscaled, tokenizer, capitals)
    print(
        f"unscaled host embeddings: top-1 agreement {wrong['top1_agreement']:.3f}, "
        f"capital recall {capital_recall:.3f}"
    )
    assert wrong["top1_agreement"] < 0.7 and wrong["kl_mean"] > 1.0
    assert capital_recall < 0.3
    paris = table_unscaled[table_unscaled["subject"] == "France"].iloc[0]
    assert paris["generated"] != "Paris ."


def test_load_and_32_token_generation_without_eos():
    """Load and a fixed-length greedy run (its time is printed, not asserted: a timed unit test
    fails on a busy machine; speed is measured side by side in notebook 07)."""
    started = time.perf_counter()
    model, tokenizer = load_model()
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = greedy_generate(model, prompt, 32)
    print(f"load + 32 greedy tokens: {time.perf_counter() - started:.2f} s")
    assert out.shape[1] == prompt.shape[1] + 32


def test_bundled_id():
    assert BUNDLED_ID == "gemma-nb/tiny-gemma4-moe"


# --- random configs and models ------------------------------------------------------------


def test_random_config_has_the_26b_architecture():
    config = random_gemma4_config()
    assert config.enable_moe_block and config.attention_k_eq_v and config.tie_word_embeddings
    assert config.hidden_size_per_layer_input == 0
    assert config.final_logit_softcapping == 30.0
    assert config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert default_layer_types(12) == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    assert default_layer_types(1) == ["full_attention"]


def test_one_full_size_layer_matches_the_26b_counts():
    """Counts per group for one 26B layer = the whole model's count / 30 (tests/test_memory.py pins
    it), on the meta device."""
    config = random_gemma4_config(num_hidden_layers=6, **FULL_LAYER)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    params = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    shared_mlp = sum(p.numel() for n, p in params.items() if ".mlp." in n)
    router = sum(p.numel() for n, p in params.items() if ".router." in n)
    attention = sum(
        p.numel() for n, p in params.items() if "self_attn" in n and n.endswith("proj.weight")
    )
    assert experts * 5 == 22_837_985_280
    assert shared_mlp * 5 == 535_265_280
    assert router * 5 == 10_901_760
    assert attention * 5 == 1_110_179_840
    assert params["model.embed_tokens.weight"].numel() == 738_197_504


def test_random_config_validates():
    with pytest.raises(ValueError, match="top_k_experts=9 exceeds num_experts=8"):
        random_gemma4_config(num_experts=8, top_k_experts=9)
    with pytest.raises(ValueError, match="num_hidden_layers=0"):
        random_gemma4_config(num_hidden_layers=0)
    with pytest.raises(ValueError, match="num_attention_heads=6.*num_key_value_heads=4"):
        random_gemma4_config(num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match="layer_types.*num_hidden_layers=4"):
        random_gemma4_config(layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="last layer"):
        random_gemma4_config(
            num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"]
        )
    with pytest.raises(ValueError, match="unknown Gemma4TextConfig field"):
        random_gemma4_config(num_expert=4)
    with pytest.raises(ValueError, match="hidden_size=-1"):
        random_gemma4_config(hidden_size=-1)


def test_random_model_is_deterministic_and_in_dtype():
    config = random_gemma4_config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        head_dim=8,
        global_head_dim=16,
        moe_intermediate_size=16,
    )
    a = random_gemma4_model(config, seed=1, dtype=torch.bfloat16)
    b = random_gemma4_model(config, seed=1, dtype=torch.bfloat16)
    c = random_gemma4_model(config, seed=2, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in a.parameters())
    assert not a.training
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(
        a.model.layers[0].experts.gate_up_proj, c.model.layers[0].experts.gate_up_proj
    )


PORTABLE_WEIGHTS = """
import hashlib, torch
from gemma_nb.tiny import random_gemma4_config, random_gemma4_model
config = random_gemma4_config(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    head_dim=8, global_head_dim=16, moe_intermediate_size=16,
)
model = random_gemma4_model(config, seed=1, dtype=torch.bfloat16, init_dtype=torch.float64)
digest = hashlib.sha256()
for p in model.state_dict().values():
    digest.update(p.float().numpy().tobytes())
print(digest.hexdigest())
"""


def test_weights_drawn_in_float64_are_the_same_on_every_cpu():
    """torch's float32 normals differ between its AVX2 and default kernels; float64 draws do not.
    This process draws with the cpu's own kernels; a fresh one per other capability."""
    import contextlib
    import io
    import os
    import subprocess
    import sys

    here = io.StringIO()
    with contextlib.redirect_stdout(here):
        exec(PORTABLE_WEIGHTS, {})
    native = torch.backends.cpu.get_cpu_capability().lower()
    digests = {here.getvalue()} | {
        subprocess.run(
            [sys.executable, "-c", PORTABLE_WEIGHTS],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "ATEN_CPU_CAPABILITY": capability},
        ).stdout
        for capability in ("avx2", "default")
        if capability != native
    }
    assert len(digests) == 1, digests


def test_training_script_is_deterministic(tmp_path):
    """Two one-epoch runs of the training code write byte-identical weights that load and
    generate."""
    from gemma_nb.tiny.train import TrainArgs, train

    args = TrainArgs(max_epochs=1, eval_every_epochs=1)
    first = train(args, out_dir=tmp_path / "a", log=lambda line: None)
    train(args, out_dir=tmp_path / "b", log=lambda line: None)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
    assert first["steps_run"] == 8 and first["args"]["seed"] == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    # transformers' default, not a training setting
    assert model.config._experts_implementation == "grouped_mm"
    assert "_experts_implementation" not in (tmp_path / "a" / "config.json").read_text()
    assert not torch.are_deterministic_algorithms_enabled()  # global torch state restored


# --- the TP=2 checkpoint ------------------------------------------------------------------


def test_tp2_checkpoint_resolves_splits_at_tp2_and_recalls_facts():
    from gemma_nb.export import layer_kv_heads
    from gemma_nb.modelio import resolve_model_id
    from gemma_nb.neuron.checkpoint import read_hf_state, text_config
    from gemma_nb.tiny import BUNDLED_TP2_ID, TP2_CHECKPOINT_DIR, TP2_DIMS
    from gemma_nb.tiny.train import INDEX_FILE

    folder = resolve_model_id(BUNDLED_TP2_ID)
    assert folder == str(TP2_CHECKPOINT_DIR)
    for name in (
        *[n for n in CHECKPOINT_FILES if n != "model.safetensors"],
        "README.md",
        INDEX_FILE,
    ):
        assert (TP2_CHECKPOINT_DIR / name).is_file()
    # stored as the hub stores the 26B: a multimodal config, prefixed names, two shards and their
    # index
    index = json.loads((TP2_CHECKPOINT_DIR / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert all(key.startswith("model.language_model.") for key in index["weight_map"])
    assert sum((TP2_CHECKPOINT_DIR / s).stat().st_size for s in shards) < 20e6
    raw = json.loads((TP2_CHECKPOINT_DIR / "config.json").read_text())
    assert raw["model_type"] == "gemma4" and raw["text_config"]["model_type"] == "gemma4_text"
    config = text_config(folder)
    model = Gemma4ForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(read_hf_state(folder), strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    # 8 -> 4 and 2 -> 1 per rank at TP=2
    assert {heads for heads, _ in layer_kv_heads(config)} == {
        8,
        2,
    }
    assert (
        config.num_attention_heads == 16
        and config.num_experts % 2 == 0
        and config.vocab_size % 2 == 0
    )
    assert config.moe_intermediate_size == TP2_DIMS["moe_intermediate_size"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert tokenizer.decode(greedy_generate(model, prompt, 2)[0, prompt.shape[1] :]) == "Paris ."
    recorded = json.loads((TP2_CHECKPOINT_DIR / "training_args.json").read_text())
    assert recorded["command"] == "python -m gemma_nb.tiny train --dims tp2"
    assert recorded["args"]["dims"] == "tp2" and recorded["final_recall_fp32"] == 1.0


def test_training_dims_are_named(capsys):
    from gemma_nb.tiny.__main__ import main
    from gemma_nb.tiny.train import TrainArgs

    assert TrainArgs(dims="tp2").dims == "tp2"
    with pytest.raises(SystemExit):
        main(["train", "--dims", "tp4"])
    error = capsys.readouterr().err
    assert "--dims: invalid choice: 'tp4'" in error and "tiny" in error and "tp2" in error
