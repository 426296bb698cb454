"""The build's TP=2 graphs on two gloo ranks with the NxD stand-ins, against the unsharded int8
model (notebook 05): weights cut as ModelBuilder cuts them, prefill and decode graphs sharing one
aliased KV state, activations in fp32 so that a token flip can only come from the sharding (the bf16
router check is apart)."""

import time

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from gemma_nb.embedding import HostEmbedding
from gemma_nb.modelio import model_skeleton, resolve_model_id
from gemma_nb.neuron import build as B
from gemma_nb.neuron.deploy import NeuronStepRunner, until_eos
from gemma_nb.ranks import run_tp
from gemma_nb.rehearsal.nxd_model import check_alias
from gemma_nb.rehearsal.standins import NXD_CONTRACT_VERSION, cpu_sdk, load_rank_module
from gemma_nb.tiny import BUNDLED_TP2_ID

DEFAULT_PROMPTS = (
    "The capital of France is",
    "The currency of Japan is",
    "The language of Brazil is",
)


def rank_module(
    config,
    build: B.NeuronBuildConfig,
    checkpoint: dict,
    hf_state: dict,
    rank: int,
    sdk,
    experts: str = "dense",
    group=None,
) -> B.NeuronGemma4:
    """Rank ``rank``'s ``NeuronGemma4`` on the cpu stand-ins, loaded as ModelBuilder loads it."""
    module = load_rank_module(
        lambda: B.NeuronGemma4(config, build, parallel=True, sdk=sdk, experts=experts),
        checkpoint,
        build.tp_degree,
        rank,
        group,
        not_in_checkpoint=B.KV_STATE_PREFIXES,
    )
    B.fill_layer_scalars(module, hf_state)
    return module


class AliasedGraphs:
    """A prefill graph and a decode graph over one KV state, written back through the aliases."""

    def __init__(self, prefill, decode, bucket: int):
        self.graphs, self.bucket = {"prefill": prefill, "decode": decode}, bucket
        self.state = {
            name: p.detach().clone()
            for name, p in prefill.named_parameters()
            if name.startswith(B.KV_STATE_PREFIXES)
        }
        self.calls = dict.fromkeys(self.graphs, 0)
        self.logits = []  # every call's output, for the comparison

    def __call__(self, *inputs):
        kind = "prefill" if inputs[0].shape[1] == self.bucket else "decode"
        module = self.graphs[kind]
        names = {id(p): name for name, p in module.named_parameters()}
        with torch.no_grad():
            for name, parameter in module.named_parameters():
                if name in self.state:
                    parameter.copy_(self.state[name])
            outputs = module(*inputs)
            for parameter, index in module.input_output_aliases().items():
                name, out = names[id(parameter)], outputs[index]
                check_alias(index, out, name, self.state[name])  # XLA's rule
                self.state[name] = out.detach().clone()
        self.calls[kind] += 1
        self.logits.append(outputs[0][0, -1].detach().clone())
        return outputs[0]


def _setup(model_dir: str, tp: int, max_len: int, bucket: int, dtype: str = "float32"):
    config, hf_state = B.text_config(model_dir), B.read_hf_state(model_dir)
    build = B.NeuronBuildConfig(
        model_dir=model_dir,
        output_dir="unused",
        tp_degree=tp,
        max_len=max_len,
        bucket=bucket,
        dtype=dtype,
    )
    checkpoint = B.convert_checkpoint(hf_state, config, dtype=getattr(torch, dtype))
    scale = torch.tensor(model_skeleton(config).get_input_embeddings().scalar_embed_scale)
    embed = HostEmbedding(hf_state["model.embed_tokens.weight"].float(), scale)
    return config, hf_state, build, checkpoint, embed


def _onehot_state_ok(state: dict, last_position: int) -> bool:
    """Every cache slot up to the last written position holds values, every later slot is still
    zero."""
    return all(
        bool((t[0, :, : last_position + 1].abs().sum(dim=(0, 2)) > 0).all())
        and bool(t[0, :, last_position + 1 :].abs().sum() == 0)
        for t in state.values()
    )


def decode_all(
    config,
    build,
    checkpoint,
    hf_state,
    embed,
    prompts_ids,
    new_tokens: int,
    sdk,
    rank: int = 0,
    group=None,
    modes=("dense", "sparse"),
) -> dict:
    """Greedy tokens per decode mode and prompt, with one rank's modules (a fresh KV state per
    prompt)."""
    modules = {
        mode: rank_module(config, build, checkpoint, hf_state, rank, sdk, experts=mode, group=group)
        for mode in {"dense", *modes}
    }
    tokens, logits, onehot_ok, calls = {}, {}, True, {"prefill": 0, "decode": 0}
    for mode in modes:
        tokens[mode], logits[mode] = [], []
        for ids in prompts_ids:
            graphs = AliasedGraphs(modules["dense"], modules[mode], build.bucket)
            runner = NeuronStepRunner(
                graphs, embed, config, build.max_len, build.bucket, config.pad_token_id or 0
            )
            tokens[mode].append(
                runner.generate(torch.tensor([ids]), new_tokens)[0, len(ids) :].tolist()
            )
            logits[mode].append(torch.stack(graphs.logits)[:, : config.vocab_size])
            # the bucket's padding slots are written by the prefill too, so check up to the bucket
            onehot_ok &= _onehot_state_ok(
                graphs.state, max(build.bucket, len(ids) + new_tokens - 1) - 1
            )
            for kind, count in graphs.calls.items():
                calls[kind] += count
    # KV heads of this rank's state per layer type (every layer of a type holds the same)
    kv_heads = {
        kind: int(cache.shape[1])
        for kind, cache in zip(config.layer_types, modules["dense"].k_cache)
    }
    return {
        "tokens": tokens,
        "logits": {mode: torch.cat(values) for mode, values in logits.items()},
        "kv_heads": kv_heads,
        "onehot_state_ok": onehot_ok,
        "graph_calls": calls,
        "aliased_state_tensors": len(modules["dense"].input_output_aliases()),
    }


def router_choices(module, config, embed, build, prompts_ids: list, answers: list) -> dict:
    """The top-k experts every router picks, teacher-forced: each prompt prefilled, then its
    ``answers`` one by one."""
    scores = []
    hooks = [
        layer.router.proj.register_forward_hook(lambda mod, args, out: scores.append(out.detach()))
        for layer in module.lm.model.layers
    ]
    picks, k = {"fp32_softmax": [], "bf16_softmax": []}, config.top_k_experts
    try:
        for ids, answer in zip(prompts_ids, answers):
            graphs = AliasedGraphs(module, module, build.bucket)
            runner = NeuronStepRunner(
                graphs, embed, config, build.max_len, build.bucket, config.pad_token_id or 0
            )
            padded = torch.nn.functional.pad(
                torch.tensor([ids]), (0, build.bucket - len(ids)), value=runner.pad_token_id
            )
            scores.clear()
            with torch.inference_mode():
                runner.step(padded, list(range(build.bucket)), len(ids) - 1)
                # the prompt's tokens, not the bucket's padding
                kept = [s[: len(ids)] for s in scores]
                for step, token in enumerate(answer[:-1]):
                    scores.clear()
                    runner.step(torch.tensor([[token]]), [len(ids) + step], 0)
                    kept += scores
            for name, dtype in (("fp32_softmax", torch.float32), ("bf16_softmax", torch.bfloat16)):
                for layer_scores in kept:
                    top = torch.topk(
                        torch.softmax(layer_scores.to(dtype), dim=-1, dtype=dtype), k, dim=-1
                    ).indices
                    picks[name] += [tuple(sorted(row.tolist())) for row in top]
    finally:
        for hook in hooks:
            hook.remove()
    return picks


def tp_rank_job(
    rank: int,
    world_size: int,
    model_dir: str,
    prompts_ids: list,
    answers: list,
    new_tokens: int,
    max_len: int,
    bucket: int,
) -> dict:
    """One gloo rank of :func:`tp_emulation`: :func:`decode_all` in fp32, then the bf16 router
    check."""
    config, hf_state, build, checkpoint, embed = _setup(model_dir, world_size, max_len, bucket)
    decoded = decode_all(
        config,
        build,
        checkpoint,
        hf_state,
        embed,
        prompts_ids,
        new_tokens,
        cpu_sdk(),
        rank,
        dist.group.WORLD,
    )
    config, hf_state, build, checkpoint, embed = _setup(
        model_dir, world_size, max_len, bucket, "bfloat16"
    )
    module = rank_module(
        config, build, checkpoint, hf_state, rank, cpu_sdk(), group=dist.group.WORLD
    )
    return {**decoded, "router": router_choices(module, config, embed, build, prompts_ids, answers)}


def tp_emulation(
    model_id: str = BUNDLED_TP2_ID,
    prompts=DEFAULT_PROMPTS,
    new_tokens: int = 8,
    tp: int = 2,
    max_len: int = 32,
    bucket: int = 8,
) -> dict:
    """Run the neuron graphs at TP=``tp`` on ``tp`` gloo ranks and compare with the unsharded int8
    model."""
    started = time.perf_counter()
    model_dir = resolve_model_id(model_id)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts_ids = [tokenizer(p).input_ids for p in prompts]
    config, hf_state, build, checkpoint, embed = _setup(model_dir, 1, max_len, bucket)
    reference = decode_all(
        config,
        build,
        checkpoint,
        hf_state,
        embed,
        prompts_ids,
        new_tokens,
        cpu_sdk(),
        modes=("dense",),
    )
    expected, eos = reference["tokens"]["dense"], config.eos_token_id
    module = rank_module(config, build, checkpoint, hf_state, 0, cpu_sdk())
    choices = router_choices(module, config, embed, build, prompts_ids, expected)["fp32_softmax"]
    del checkpoint, module
    ranks = run_tp(
        tp_rank_job,
        (model_dir, prompts_ids, expected, new_tokens, max_len, bucket),
        world_size=tp,
        threads_per_rank=1,
        timeout_s=600.0,
    )
    bf16 = [r["router"] for r in ranks]

    def logit_diff(mode: str) -> float:  # every rank's logits against the unsharded reference's
        return max(
            float((r["logits"][mode] - reference["logits"]["dense"]).abs().max()) for r in ranks
        )

    return {
        "model_id": model_id,
        "stand_ins": f"cpu stand-ins of neuronx-distributed {NXD_CONTRACT_VERSION} (not the SDK)",
        "tp": tp,
        "ranks": len(ranks),
        "activation_dtype": build.dtype,
        "max_len": max_len,
        "bucket": bucket,
        "prompts": len(prompts_ids),
        "new_tokens": new_tokens,
        "tokens_equal_dense": all(r["tokens"]["dense"] == expected for r in ranks),
        "tokens_equal_sparse": all(r["tokens"]["sparse"] == expected for r in ranks),
        "ranks_agree": all(r["tokens"] == ranks[0]["tokens"] for r in ranks),
        "max_abs_logit_diff_dense": logit_diff("dense"),
        "max_abs_logit_diff_sparse": logit_diff("sparse"),
        "max_abs_logit_reference": float(reference["logits"]["dense"].abs().max()),
        "kv_heads_unsharded": reference["kv_heads"],
        "kv_heads_per_rank": ranks[0]["kv_heads"],
        "kv_heads_equal_on_every_rank": all(r["kv_heads"] == ranks[0]["kv_heads"] for r in ranks),
        "aliased_state_tensors": ranks[0]["aliased_state_tensors"],
        "onehot_state_ok": all(r["onehot_state_ok"] for r in ranks),
        "graph_calls_per_rank": ranks[0]["graph_calls"],
        "router_choices": len(choices),
        "router_topk_equal_bf16": _matching(bf16[0]["fp32_softmax"], choices),
        "router_topk_equal_bf16_autocast_all": _matching(bf16[0]["bf16_softmax"], choices),
        "router_ranks_agree": all(r == bf16[0] for r in bf16),
        "prompt_texts": list(prompts),
        "reference_answers": [tokenizer.decode(until_eos(t, eos)) for t in expected],
        "reference_tokens": expected,
        "tokens_per_rank": [r["tokens"] for r in ranks],
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _matching(picks: list, choices: list) -> float:
    """The share of the bf16 ranks' top-k ``picks`` equal to the fp32 reference's ``choices``."""
    assert len(picks) == len(choices), (len(picks), len(choices))
    return sum(a == b for a, b in zip(picks, choices)) / len(choices)
