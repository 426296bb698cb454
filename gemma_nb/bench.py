"""Decode benchmarks, measured and modelled (notebook 07).

Measured:

- ``time_steps(candidates, ...)``: per-step latency of one-token steps (an MoE layer, a decode
  step), candidates taking turns step by step so machine drift hits all of them alike.
- ``time_generation(models, input_ids, ...)``: time to first token, then per-token decode latency
  of greedy generation with a KV cache; also returns the tokens, so equal outputs can be checked.
  ``time_runners`` does the same, coarser, for deployed models that only expose ``generate``.
- ``measure_bandwidth()``: a large read (sum) and copy: the machine's memory bandwidth, which sets
  the floor (``floor_ms``) of any step that must read a given number of weight bytes.
- ``sparse_breakdown_steps`` / ``breakdown_table``: a sparse MoE step split into its matmuls, its
  call overhead and (gather variant) its weight copy, timed beside it.

Both timing functions return a ``Timings``: ``summary()`` gives p50 / p90 per-token latency and
tokens/s as the median over repeats; ``ratio(a, b)`` is the median of a's step time over b's
in the same round (steps run moments apart).

Modelled (roofline, batch 1 decode): ``decode_traffic(config, scheme, experts)`` counts the bytes
every decode step must read (per rank) and its FLOPs, from ``gemma_nb.memory.plan``; ``roofline``
turns them into tokens/s and $ per million tokens over ``DEPLOYMENTS`` (devices from
``gemma_nb.hardware``). A step can be no faster than ``max(bytes / bandwidth, FLOPs / peak)``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import pandas as pd
import torch

from gemma_nb.hardware import DEVICES, GB, INSTANCES, Device
from gemma_nb.memory import SHIPPED_CONTEXT_LEN

EXPERT_MODES = ("dense", "sparse")


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def torch_threads(count: int):
    """Run the block with ``count`` torch cpu threads, then restore the previous count.

    Models with tiny matrices gain nothing from a second thread and pay a thread barrier on every
    op (on a busy machine, milliseconds each): time them on one thread.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count={count!r} must be an integer >= 1 (torch cpu threads)")
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        minimum = 0 if name == "warmup" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


def _rotated(names: Sequence[str], shift: int) -> list[str]:
    shift %= len(names)
    return list(names[shift:]) + list(names[:shift])


@dataclass
class Timings:
    """Per-step latencies of several candidates measured side by side.

    ``steps``: one row per timed step: ``candidate``, ``repeat``, ``step``, ``ms``.
    ``first_token``: generation only: ``candidate``, ``repeat``, ``ttft_ms`` (prefill + first token).
    ``tokens``: generation only: candidate -> generated token ids (LongTensor [1, S + n]).
    """

    steps: pd.DataFrame
    first_token: pd.DataFrame | None = None
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def candidates(self) -> list[str]:
        return list(dict.fromkeys(self.steps["candidate"]))

    def _check(self, name: str) -> None:
        if name not in self.candidates:
            raise ValueError(f"candidate {name!r} was not timed; timed: {', '.join(self.candidates)}")

    def per_repeat(self) -> pd.DataFrame:
        """p50 latency and tokens/s of every (candidate, repeat)."""
        grouped = self.steps.groupby(["candidate", "repeat"], sort=False)["ms"]
        table = grouped.agg(p50_ms="median", total_ms="sum", steps="count").reset_index()
        table["tok_s"] = 1000.0 * table["steps"] / table["total_ms"]
        return table

    def summary(self) -> pd.DataFrame:
        """One row per candidate: p50 / p90 / mean / min step latency (ms, all steps of all repeats),
        ``tok_s`` (median over repeats of steps / time), ``tok_s_min``/``tok_s_max`` over repeats,
        and ``ttft_ms`` (median over repeats) for generation."""
        rows = []
        per_repeat = self.per_repeat()
        for name in self.candidates:
            ms = self.steps.loc[self.steps["candidate"] == name, "ms"]
            tok_s = per_repeat.loc[per_repeat["candidate"] == name, "tok_s"]
            row = {"candidate": name, "p50_ms": ms.median(), "p90_ms": ms.quantile(0.9), "mean_ms": ms.mean(),
                   "min_ms": ms.min(), "tok_s": tok_s.median(), "tok_s_min": tok_s.min(), "tok_s_max": tok_s.max(),
                   "repeats": int(per_repeat["candidate"].eq(name).sum()), "steps_per_repeat": int(ms.size // max(1, tok_s.size))}
            if self.first_token is not None:
                row["ttft_ms"] = self.first_token.loc[self.first_token["candidate"] == name, "ttft_ms"].median()
            rows.append(row)
        return pd.DataFrame(rows).set_index("candidate")

    def ratio(self, numerator: str, denominator: str) -> float:
        """Median over rounds of numerator's step time / denominator's step time in the same round.

        A round is one step of every candidate, back to back (``time_steps``; for generation, one
        decode step index of one repeat). A ratio > 1 means ``numerator`` is slower. Pairing
        steps that ran moments apart cancels drift and bursts of load on a shared machine.
        """
        self._check(numerator)
        self._check(denominator)
        table = self.steps.pivot_table(index=["repeat", "step"], columns="candidate", values="ms")
        return float((table[numerator] / table[denominator]).median())

    def p50_ms(self, name: str) -> float:
        self._check(name)
        return float(self.steps.loc[self.steps["candidate"] == name, "ms"].median())

    def min_ms(self, name: str) -> float:
        """The fastest step: what the machine allows when nothing else interferes."""
        self._check(name)
        return float(self.steps.loc[self.steps["candidate"] == name, "ms"].min())


def time_steps(candidates: Mapping[str, Callable[[int], Any]], steps: int = 16, repeats: int = 5, warmup: int = 2,
               device: str = "cpu") -> Timings:
    """Time one-token steps of each candidate, interleaved.

    ``candidates``: name -> ``fn(i)`` doing one step; ``i`` counts the calls of that candidate
    (0, 1, ... across repeats), so a step can take the i-th routing of a prepared list. Each
    candidate first runs ``warmup`` untimed steps. Then, per repeat, ``steps`` rounds: each round
    runs one timed step of every candidate, in an order that rotates by one each round, so a burst
    of load on a shared machine hits all candidates alike. On cuda the device is synchronised
    around every step.
    """
    _check_counts(steps=steps, repeats=repeats, warmup=warmup)
    if not candidates:
        raise ValueError("candidates is empty: pass {name: step_fn}")
    names = list(candidates)
    calls = dict.fromkeys(names, 0)
    with torch.inference_mode():
        for name in names:
            for _ in range(warmup):
                candidates[name](calls[name])
                calls[name] += 1
        _sync(device)
        rows = []
        for repeat in range(repeats):
            for step in range(steps):
                for name in _rotated(names, repeat * steps + step):
                    start = time.perf_counter()
                    candidates[name](calls[name])
                    _sync(device)
                    rows.append((name, repeat, step, 1000.0 * (time.perf_counter() - start)))
                    calls[name] += 1
    return Timings(pd.DataFrame(rows, columns=["candidate", "repeat", "step", "ms"]))


def _generate_timed(model, input_ids: torch.Tensor, new_tokens: int, device: str) -> tuple[float, list[float], torch.Tensor]:
    """Greedy generation with a KV cache: (ttft_ms, per-token decode ms, tokens [1, S + new_tokens])."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    _sync(device)
    start = time.perf_counter()
    logits = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    token = logits[:, -1].argmax(dim=-1, keepdim=True)
    _sync(device)
    ttft_ms = 1000.0 * (time.perf_counter() - start)
    generated = [token]
    decode_ms = []
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        logits = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
        _sync(device)
        decode_ms.append(1000.0 * (time.perf_counter() - start))
        generated.append(token)
    return ttft_ms, decode_ms, torch.cat([input_ids, *generated], dim=1)


def time_generation(models: Mapping[str, Any], input_ids, new_tokens: int = 32, repeats: int = 3, warmup: int = 1,
                    device: str = "cpu") -> Timings:
    """Greedy generation of ``new_tokens`` tokens by each model, interleaved across repeats.

    ``models``: name -> a transformers causal LM, or a zero-argument function that prepares the
    model (e.g. swaps its experts) and returns it: called before each of that candidate's runs,
    outside the timed region. Time to first token = prefill + the first token; the per-token rows
    are the ``new_tokens - 1`` decode steps after it. Raises ValueError if a model's tokens change
    between repeats (non-deterministic decoding would make the comparison meaningless).
    """
    _check_counts(new_tokens=new_tokens, repeats=repeats, warmup=warmup)
    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens} must be >= 2 (one first token, then decode steps)")
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    ids = (ids[None] if ids.dim() == 1 else ids).to(device)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids of shape {tuple(ids.shape)}; expected one prompt [S] or [1, S] (batch 1 decode)")
    names = list(models)

    def prepared(name):
        model = models[name]
        return model if isinstance(model, torch.nn.Module) else model()

    steps, firsts, tokens = [], [], {}
    with torch.inference_mode():
        for name in names:
            for _ in range(warmup):
                _generate_timed(prepared(name), ids, min(new_tokens, 4), device)
        for repeat in range(repeats):
            for name in _rotated(names, repeat):
                ttft, decode, out = _generate_timed(prepared(name), ids, new_tokens, device)
                if name in tokens and not torch.equal(tokens[name], out.cpu()):
                    raise ValueError(f"candidate {name!r} generated different tokens in repeat {repeat}")
                tokens[name] = out.cpu()
                firsts.append((name, repeat, ttft))
                steps += [(name, repeat, step, ms) for step, ms in enumerate(decode)]
    return Timings(pd.DataFrame(steps, columns=["candidate", "repeat", "step", "ms"]),
                   pd.DataFrame(firsts, columns=["candidate", "repeat", "ttft_ms"]), tokens)


def time_runners(runners: Mapping[str, Any], input_ids, new_tokens: int = 32, repeats: int = 3) -> pd.DataFrame:
    """Time to first token and decode tok/s of deployed models that expose only ``generate``.

    ``runners``: name -> object with ``generate(input_ids, max_new_tokens)`` (a slim deploy, a
    Neuron deploy). Per repeat and runner (order rotating): ``ttft_s`` = time of ``generate(ids, 1)``;
    ``decode_tok_s`` = ``(new_tokens - 1) / (time of generate(ids, new_tokens) - ttft_s)``. Coarser
    than ``time_generation`` (no per-token latencies), but needs nothing from the runner's inside.
    Returns one row per runner: medians over repeats and the generated tokens.
    """
    _check_counts(new_tokens=new_tokens, repeats=repeats)
    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens} must be >= 2 (one first token, then decode steps)")
    names = list(runners)
    rows = []
    for repeat in range(repeats):
        for name in _rotated(names, repeat):
            start = time.perf_counter()
            runners[name].generate(input_ids, 1)
            ttft_s = time.perf_counter() - start
            start = time.perf_counter()
            tokens = runners[name].generate(input_ids, new_tokens)
            total_s = time.perf_counter() - start
            rows.append({"runner": name, "repeat": repeat, "ttft_s": ttft_s,
                         "decode_tok_s": (new_tokens - 1) / max(total_s - ttft_s, 1e-9),
                         "tokens": torch.as_tensor(tokens)[0].tolist()})
    table = pd.DataFrame(rows)
    summary = table.groupby("runner", sort=False).agg(ttft_s=("ttft_s", "median"), decode_tok_s=("decode_tok_s", "median"),
                                                      tokens=("tokens", "last"))
    return summary


def random_model_on_device(config, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A ``Gemma4ForCausalLM`` with random weights allocated and initialised directly on ``device``.

    Built under ``torch.device(device)``: every parameter is created on the device and initialised
    there, so the 26B (50.5 GB in bf16) never touches host RAM on a GPU box. For benchmarks only:
    random weights say nothing about answers, only about time.
    """
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Gemma4ForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


# --------------------------------------------------------------------------------------------
# Memory bandwidth
# --------------------------------------------------------------------------------------------


def measure_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5, device: str = "cpu") -> dict:
    """Read and copy bandwidth over a bf16 buffer of ``nbytes`` (far larger than any cache).

    ``read_gb_s``: ``nbytes`` / time of ``buffer.sum()``; ``copy_gb_s``: 2 x ``nbytes`` (read + write)
    / time of ``dst.copy_(src)``. Best of ``repeats`` (the STREAM convention: the machine can do at
    least this), with the median alongside. GB = 10^9 bytes.
    """
    _check_counts(repeats=repeats)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 2**20:
        raise ValueError(f"nbytes={nbytes!r} must be an integer >= 1 MiB (use >= 256 MiB to defeat caches)")
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    timings = {"read": [], "copy": []}
    with torch.inference_mode():
        for _ in range(repeats):
            for kind in ("read", "copy"):
                _sync(device)
                start = time.perf_counter()
                src.sum() if kind == "read" else dst.copy_(src)
                _sync(device)
                timings[kind].append(time.perf_counter() - start)
    moved = {"read": src.numel() * 2, "copy": 2 * src.numel() * 2}
    result = {"nbytes": src.numel() * 2, "device": str(device)}
    for kind, seconds in timings.items():
        result[f"{kind}_gb_s"] = moved[kind] / min(seconds) / GB
        result[f"{kind}_gb_s_median"] = moved[kind] / statistics.median(seconds) / GB
    return result


def floor_ms(nbytes: float, bandwidth_bytes_s: float) -> float:
    """The shortest time (ms) in which ``nbytes`` can be read at ``bandwidth_bytes_s``."""
    if not bandwidth_bytes_s or bandwidth_bytes_s <= 0:
        raise ValueError(f"bandwidth_bytes_s={bandwidth_bytes_s!r} must be positive (bytes per second)")
    return 1000.0 * nbytes / bandwidth_bytes_s


def moe_layer_bytes(num_experts: int, hidden: int, intermediate: int, top_k: int, experts: str = "dense",
                    dtype: str = "bf16") -> int:
    """Weight bytes one token must read in one MoE layer: all E experts (dense) or its top-k (sparse).

    ``dtype`` is a ``gemma_nb.memory`` format (``bf16``, ``int8`` with fp32 row scales, ...). At full
    size: dense bf16 1.52 GB, sparse bf16 95.2 MB, sparse int8 47.7 MB.
    """
    from gemma_nb.memory import tensor_bytes

    _check_mode(experts)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    per_expert = tensor_bytes((2 * intermediate, hidden), dtype) + tensor_bytes((hidden, intermediate), dtype)
    return per_expert * (num_experts if experts == "dense" else top_k)


def _check_mode(experts: str) -> None:
    if experts not in EXPERT_MODES:
        raise ValueError(f"experts={experts!r} is not one of {', '.join(EXPERT_MODES)}")


# --------------------------------------------------------------------------------------------
# Roofline: bytes and FLOPs per decoded token
# --------------------------------------------------------------------------------------------

# Groups every decode step reads in full. Embeddings are looked up on the host (one row per token,
# ~5.6 KB: ignored); lm_head is the device copy of the tied table, read in full for the logits.
READ_GROUPS = ("router", "shared_mlp", "attention", "norms", "lm_head", "other")
MATMUL_GROUPS = ("router", "shared_mlp", "attention", "lm_head")


def decode_traffic(config, scheme: str = "int8_squeeze", experts: str = "dense", tp: int = 1,
                   context_len: int = 0) -> dict:
    """Bytes each rank reads and FLOPs it computes to decode one token (batch 1).

    Bytes come from ``gemma_nb.memory.plan(config, tp, scheme, context_len)``: every group a step
    uses in full (attention, shared MLP, router, norms, lm_head), the routed experts in full
    (``dense``) or ``top_k / E`` of them (``sparse``; assumes each expert is split across ranks,
    as NxD Inference shards the intermediate dimension, so the 8 routed experts load every rank
    evenly), plus the KV cache of ``context_len`` tokens. FLOPs: 2 per weight of every matrix used,
    plus attention over the context (4 x context x heads x head_dim per layer), divided by ``tp``.
    """
    from gemma_nb.memory import model_facts, plan

    _check_mode(experts)
    facts = model_facts(config)
    the_plan = plan(config, tp, scheme, context_len=context_len)
    table = the_plan.table.set_index("group")
    fraction = facts.top_k / facts.num_experts if experts == "sparse" else 1.0
    by_group = {group: float(table.loc[group, "bytes_per_rank"]) for group in READ_GROUPS}
    by_group["experts"] = float(table.loc["experts", "bytes_per_rank"]) * fraction
    by_group["kv_cache"] = float(table.loc["kv_cache", "bytes_per_rank"])
    # Matrices only: the router's scale vectors and the norms cost ~1 FLOP per element, not 2.
    matmul_params = sum(float(rec.numel) for rec in facts.records
                        if not rec.is_buffer and len(rec.shape) >= 2 and rec.group in MATMUL_GROUPS)
    if facts.tied and facts.lm_head_shape is not None:
        matmul_params += float(facts.lm_head_shape[0] * facts.lm_head_shape[1])
    matmul_params += float(table.loc["experts", "params"]) * fraction
    attention_flops = sum(4.0 * context_len * layer.q_heads * layer.head_dim for layer in facts.attention_layers)
    return {
        "scheme": the_plan.scheme.name,
        "experts": experts,
        "tp": tp,
        "context_len": context_len,
        "bytes_per_token": sum(by_group.values()),
        "flops_per_token": (2.0 * matmul_params + attention_flops) / tp,
        "weights_bytes_per_rank": float(the_plan.weights_bytes),
        "bytes_by_group": by_group,
    }


@dataclass(frozen=True)
class Deployment:
    """The 26B served on ``ranks`` devices of one kind, tensor-parallel, with one weight scheme.

    ``device``: a key of ``gemma_nb.hardware.DEVICES`` or a ``Device`` (e.g. ``measured_cpu``).
    ``usd_per_hour``: for the whole deployment; ``None`` = the device's $/h x ranks (``None`` if unknown).
    """

    name: str
    device: str | Device
    ranks: int
    scheme: str
    usd_per_hour: float | None = None

    def resolved_device(self) -> Device:
        if isinstance(self.device, Device):
            return self.device
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is not in gemma_nb.hardware.DEVICES ({', '.join(DEVICES)})")
        return DEVICES[self.device]

    def price(self) -> float | None:
        if self.usd_per_hour is not None:
            return self.usd_per_hour
        per_device = self.resolved_device().usd_per_hour
        return None if per_device is None else per_device * self.ranks


STORY_INSTANCE = "inf2.xlarge"
DEPLOYMENTS: tuple[Deployment, ...] = (
    Deployment("inf2.xlarge, int8 squeeze, TP=2", "neuroncore_v2", 2, "int8_squeeze",
               INSTANCES["inf2.xlarge"].usd_per_hour),
    Deployment("inf2.xlarge, bf16, TP=2", "neuroncore_v2", 2, "bf16", INSTANCES["inf2.xlarge"].usd_per_hour),
    Deployment("TPU v6e x1, int8 squeeze", "tpu_v6e_chip", 1, "int8_squeeze"),
    Deployment("TPU v6e x2, bf16, TP=2", "tpu_v6e_chip", 2, "bf16"),
    Deployment("H200 x1, bf16", "h200", 1, "bf16"),
    Deployment("H200 x1, int8 squeeze", "h200", 1, "int8_squeeze"),
)


def usd_per_million_tokens(usd_per_hour: float | None, tok_s: float) -> float | None:
    """$ per 10^6 tokens for one stream decoding at ``tok_s`` on a box costing ``usd_per_hour``."""
    if usd_per_hour is None or not tok_s or tok_s <= 0:
        return None
    return usd_per_hour / (tok_s * 3600.0) * 1e6


def roofline(config, deployments: Sequence[Deployment] = DEPLOYMENTS, experts: Sequence[str] = EXPERT_MODES,
             context_len: int = SHIPPED_CONTEXT_LEN) -> pd.DataFrame:
    """Predicted batch-1 decode speed of ``config`` on each deployment, dense vs sparse experts.

    Every step also reads the KV cache of ``context_len`` tokens (default: the port's static
    512-token cache, in each scheme's KV dtype, fp32 for the port's builds).

    Per row: ``gb_per_token`` (per rank), ``gflop_per_token`` (per rank), ``memory_ms`` =
    bytes / bandwidth, ``compute_ms`` = FLOPs / bf16 peak (int8 weights are upcast to bf16 for the
    matmul, as NxD does), ``bound`` (the larger), ``tok_s`` = 1000 / max(...), ``fits`` (weights +
    KV per rank within the device memory), ``usd_per_hour``, ``usd_per_m_tokens``. An upper bound:
    real steps add kernel launches, collectives and the host loop.
    """
    rows = []
    for deployment in deployments:
        device = deployment.resolved_device()
        if not device.bandwidth_bytes_s:
            raise ValueError(f"device {device.name!r} has no bandwidth figure; measure it (hardware.measured_cpu)")
        for mode in experts:
            traffic = decode_traffic(config, deployment.scheme, mode, deployment.ranks, context_len)
            memory_ms = 1000.0 * traffic["bytes_per_token"] / device.bandwidth_bytes_s
            compute_ms = 1000.0 * traffic["flops_per_token"] / device.bf16_flops if device.bf16_flops else 0.0
            tok_s = 1000.0 / max(memory_ms, compute_ms)
            resident = traffic["weights_bytes_per_rank"] + traffic["bytes_by_group"]["kv_cache"]
            price = deployment.price()
            rows.append({
                "deployment": deployment.name, "device": device.name, "ranks": deployment.ranks,
                "scheme": deployment.scheme, "experts": mode,
                "gb_per_token": traffic["bytes_per_token"] / GB,
                "gflop_per_token": traffic["flops_per_token"] / 1e9,
                "memory_ms": memory_ms, "compute_ms": compute_ms,
                "bound": "memory" if memory_ms >= compute_ms else "compute",
                "tok_s": tok_s,
                "fits": None if device.hbm_bytes is None else bool(resident <= device.hbm_bytes),
                "usd_per_hour": price, "usd_per_m_tokens": usd_per_million_tokens(price, tok_s),
            })
    return pd.DataFrame(rows)


def story_decode(config, measured_tok_s: float | None = None, tp: int = 2, scheme: str = "int8_squeeze",
                 device: str = "neuroncore_v2", context_len: int = SHIPPED_CONTEXT_LEN) -> dict:
    """The story's decode figures on inf2.xlarge, computed, with the hypotheses for its 6 tok/s.

    Each step reads the weights it uses plus the KV cache of ``context_len`` tokens (default the
    port's static 512-token fp32 cache, which a static graph reads in full whatever the prompt's
    length; ``kv_gb_per_token`` says how much). Returns per-chip bytes (both ranks) and tok/s: ``dense_gb_per_token`` / ``dense_tok_s`` (the
    DenseExperts roofline), ``sparse_*`` (top-k gather), ``upcast_gb_per_token`` /
    ``upcast_tok_s`` (HYPOTHESIS: each step the int8 experts are upcast to a bf16 copy in HBM and
    read again: 1 + 2 + 2 bytes per expert weight), ``compute_bound_tok_s`` (FLOPs / peak: what
    "compute-bound" would allow), ``expert_flops_waste_x`` (E / K), ``answer_500_tokens_s`` at each
    rate, and $ per million tokens at the measured rate (``measured_tok_s``, default the story's
    claim) and at the rooflines.
    """
    from gemma_nb.memory import model_facts, plan
    from gemma_nb.story import CLAIMS

    facts = model_facts(config)
    bandwidth = DEVICES[device].bandwidth_bytes_s
    peak = DEVICES[device].bf16_flops
    dense = decode_traffic(config, scheme, "dense", tp, context_len)
    sparse = decode_traffic(config, scheme, "sparse", tp, context_len)
    # The int8 experts are still read once; the bf16 copy is written, then read by the matmul.
    experts_bf16 = float(plan(config, tp, "bf16", context_len=0).bytes("experts"))
    upcast = dense["bytes_per_token"] + 2 * experts_bf16
    measured = CLAIMS["decode_tok_s"].value if measured_tok_s is None else measured_tok_s
    price = INSTANCES[STORY_INSTANCE].usd_per_hour
    out = {
        "context_len": context_len,
        "kv_gb_per_token": tp * dense["bytes_by_group"]["kv_cache"] / GB,
        "dense_gb_per_token": tp * dense["bytes_per_token"] / GB,
        "sparse_gb_per_token": tp * sparse["bytes_per_token"] / GB,
        "upcast_gb_per_token": tp * upcast / GB,
        "dense_gflop_per_token": tp * dense["flops_per_token"] / 1e9,
        "dense_expert_gflop_per_token": 2.0 * float(plan(config, tp, scheme, context_len=0).table
                                                    .set_index("group").loc["experts", "params"]) / 1e9,
        "sparse_gflop_per_token": tp * sparse["flops_per_token"] / 1e9,
        "dense_tok_s": bandwidth / dense["bytes_per_token"],
        "sparse_tok_s": bandwidth / sparse["bytes_per_token"],
        "upcast_tok_s": bandwidth / upcast,
        "compute_bound_tok_s": peak / dense["flops_per_token"],
        "measured_tok_s": measured,
        "expert_flops_waste_x": facts.num_experts / facts.top_k,
        "usd_per_hour": price,
    }
    out["utilisation_at_measured_pct"] = 100.0 * measured / out["compute_bound_tok_s"]
    for key in ("dense", "sparse", "upcast", "measured"):
        rate = out[f"{key}_tok_s"]
        out[f"{key}_answer_500_tokens_s"] = 500.0 / rate
        out[f"{key}_usd_per_m_tokens"] = usd_per_million_tokens(price, rate)
    return out


def context_sensitivity(config, context_lens: Sequence[int], **story_kwargs) -> pd.DataFrame:
    """``story_decode`` at each KV-cache length: how much the roofline depends on the context.

    One row per ``context_len``: ``kv_gb_per_token`` (per chip), ``dense_tok_s``, ``sparse_tok_s``
    and their ratio ``sparse_vs_dense_x``. The cache grows with every token while the weights stay,
    so the sparse path, which reads fewer weight bytes, loses a larger share of its speed to it.
    """
    if not context_lens:
        raise ValueError("context_lens is empty: give the KV-cache lengths to evaluate, e.g. (0, 512, 4096)")
    bad = [n for n in context_lens if int(n) != n or n < 0]
    if bad:
        raise ValueError(f"context_lens {bad} must be whole numbers of tokens >= 0")
    rows = []
    for context_len in context_lens:
        story = story_decode(config, context_len=int(context_len), **story_kwargs)
        rows.append({"context_len": int(context_len), "kv_gb_per_token": story["kv_gb_per_token"],
                     "dense_tok_s": story["dense_tok_s"], "sparse_tok_s": story["sparse_tok_s"],
                     "sparse_vs_dense_x": story["sparse_tok_s"] / story["dense_tok_s"]})
    return pd.DataFrame(rows)


def plot_context_sensitivity(table: pd.DataFrame, ax, marked_context_len: int | None = None) -> None:
    """Predicted tokens/s against the KV-cache length, dense vs sparse experts (log x axis)."""
    from gemma_nb.plots import reference_line

    for column, label in (("dense_tok_s", "DenseExperts"), ("sparse_tok_s", "sparse top-k")):
        ax.plot(table["context_len"].clip(lower=1), table[column], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV-cache length read per step (tokens, log scale; 0 drawn at 1)")
    ax.set_ylabel("tokens/s, bandwidth roofline")
    ax.legend(loc="upper right", fontsize=9)
    if marked_context_len is not None:
        reference_line(ax, max(marked_context_len, 1), f"this run: {marked_context_len} tokens", axis="x")


def hypotheses_table(story: Mapping[str, float]) -> pd.DataFrame:
    """What could make the DenseExperts deploy decode at the measured rate: one row per explanation.

    ``status`` says which rows are measured, computed bounds, or hypotheses (not verified on an inf2).
    """
    measured = story["measured_tok_s"]
    rows = [
        ("measured by the port (seed)", "claim", None, measured),
        ("bandwidth roofline, DenseExperts: every int8 expert read once per token", "computed bound",
         story["dense_gb_per_token"], story["dense_tok_s"]),
        ("HYPOTHESIS: int8 experts upcast to a bf16 copy in HBM, then read (1+2+2 B per weight)", "hypothesis",
         story["upcast_gb_per_token"], story["upcast_tok_s"]),
        ("HYPOTHESIS: compute-bound (model card's words) at full bf16 peak", "hypothesis",
         None, story["compute_bound_tok_s"]),
        ("bandwidth roofline, sparse top-k gather", "computed bound", story["sparse_gb_per_token"],
         story["sparse_tok_s"]),
    ]
    table = pd.DataFrame(rows, columns=["explanation", "status", "gb_per_token", "tok_s"])
    table["x_measured"] = table["tok_s"] / measured
    return table


# --------------------------------------------------------------------------------------------
# One MoE layer: candidates, and where a sparse step's time goes
# --------------------------------------------------------------------------------------------


def layer_steps(modules: Mapping[str, Callable], hidden_states: torch.Tensor,
                routes: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Callable[[int], Any]]:
    """``time_steps`` candidates: step i runs ``module(hidden_states, *routes[i % len(routes)])``.

    A fresh routing per step keeps a step from finding the previous step's experts in cache.
    """
    if not routes:
        raise ValueError("routes is empty: pass [(top_k_index, top_k_weights), ...] (see moe.random_routing)")
    return {name: (lambda i, m=module: m(hidden_states, *routes[i % len(routes)])) for name, module in modules.items()}


def _kernel_only(module, hidden_states, routes):
    """The K experts' matmuls alone, ids known in advance: no routing, checks, or combine."""
    from gemma_nb.experts import int8_linear

    ids = [route[0][0].tolist() for route in routes]
    x = hidden_states[:1].contiguous()
    inter = torch.zeros(1, module.intermediate_dim, dtype=x.dtype, device=x.device)
    if module.int8:
        def step(i):
            for e in ids[i % len(ids)]:
                int8_linear(x, module.gate_up_proj[e], module.gate_up_kernel_scale[e], module.gate_up_scale[e])
                int8_linear(inter, module.down_proj[e], module.down_kernel_scale[e], module.down_scale[e])
    else:
        def step(i):
            for e in ids[i % len(ids)]:
                torch.nn.functional.linear(x, module.gate_up_proj[e])
                torch.nn.functional.linear(inter, module.down_proj[e])
    return step


def sparse_breakdown_steps(module, tiny_module, hidden_states: torch.Tensor, tiny_hidden_states: torch.Tensor,
                           routes, prefix: str, gather: bool = True) -> dict[str, Callable[[int], Any]]:
    """Candidates that split one sparse decode step (1 token) into what it is made of:

    - ``<prefix>:kernel``: the 2 K matmuls alone on the selected experts' weights (the weight
      stream through the kernel; its GB/s is the kernel's reach).
    - ``<prefix>:overhead``: the same SparseExperts at tiny width (H=64, I=16: weights ~0 bytes)
      with the same E and K: Python, dispatch, routing checks and the combine.
    - ``<prefix>:gather_copy``: ``gate_up_proj[idx]`` and ``down_proj[idx]`` alone, what
      ``selection="gather"`` adds before its matmuls (only with ``gather=True``).

    The kernel path calls ``experts.int8_linear`` for int8 (the fused cpu kernel where usable).
    """
    steps = {
        f"{prefix}:kernel": _kernel_only(module, hidden_states, routes),
        f"{prefix}:overhead": lambda i: tiny_module(tiny_hidden_states, *routes[i % len(routes)]),
    }
    if gather:
        steps[f"{prefix}:gather_copy"] = lambda i: (module.gate_up_proj[routes[i % len(routes)][0][0]],
                                                    module.down_proj[routes[i % len(routes)][0][0]])
    return steps


def breakdown_table(timings: Timings, prefixes: Sequence[str], weight_bytes: Mapping[str, float],
                    bandwidth_bytes_s: float) -> pd.DataFrame:
    """Per sparse candidate: measured p50, its bandwidth floor, and the parts measured beside it (ms).

    ``weight_bytes``: prefix -> bytes one step must read. Columns: ``floor_ms``, ``step_ms`` (p50),
    ``x_floor`` (step / floor), ``best_step_ms`` / ``best_x_floor`` (the fastest step), ``kernel_ms`` and ``kernel_gb_s`` (achieved by the matmuls alone),
    ``overhead_ms`` (tiny layer), ``kernel_plus_overhead_ms`` (what the two explain),
    ``gather_copy_ms`` (NaN when not timed).
    """
    rows = []
    for prefix in prefixes:
        floor = floor_ms(weight_bytes[prefix], bandwidth_bytes_s)
        step, kernel = timings.p50_ms(prefix), timings.p50_ms(f"{prefix}:kernel")
        overhead = timings.p50_ms(f"{prefix}:overhead")
        gather = (timings.p50_ms(f"{prefix}:gather_copy") if f"{prefix}:gather_copy" in timings.candidates
                  else float("nan"))
        rows.append({"candidate": prefix, "floor_ms": floor, "step_ms": step, "x_floor": step / floor,
                     "best_step_ms": timings.min_ms(prefix), "best_x_floor": timings.min_ms(prefix) / floor,
                     "kernel_ms": kernel, "kernel_gb_s": weight_bytes[prefix] / kernel / 1e6,
                     "overhead_ms": overhead, "kernel_plus_overhead_ms": kernel + overhead,
                     "gather_copy_ms": gather})
    return pd.DataFrame(rows).set_index("candidate")


def explain_floor_gap(row: Mapping[str, float], target_x: float = 1.5, probe_gb_s: float | None = None) -> str:
    """One sentence from a ``breakdown_table`` row: target met or missed, by how much, and what the parts say."""
    verdict = "meets" if row["x_floor"] <= target_x else "misses"
    text = (f"{row['step_ms']:.2f} ms = {row['x_floor']:.2f}x its {row['floor_ms']:.2f} ms bandwidth floor: "
            f"{verdict} the <= {target_x}x target")
    if row["x_floor"] > target_x:
        text += f" by {row['x_floor'] / target_x:.2f}x"
    probe = f" vs {probe_gb_s:.1f} GB/s probed" if probe_gb_s else ""
    text += (f". The matmuls alone take {row['kernel_ms']:.2f} ms ({row['kernel_gb_s']:.1f} GB/s{probe}); "
             f"routing and call overhead (tiny layer) {row['overhead_ms']:.2f} ms; the two add up to "
             f"{row['kernel_plus_overhead_ms']:.2f} ms against the step's {row['step_ms']:.2f} ms.")
    return text


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------


def plot_latency(timings: Timings, ax, candidates: Sequence[str] | None = None) -> None:
    """Per-step latency of each candidate (ms, log scale): box + points, all repeats pooled."""
    import seaborn as sns

    names = list(candidates or timings.candidates)
    data = timings.steps[timings.steps["candidate"].isin(names)]
    sns.boxplot(data=data, x="ms", y="candidate", order=names, ax=ax, color="0.85", fliersize=0, linewidth=0.8)
    sns.stripplot(data=data, x="ms", y="candidate", order=names, ax=ax, size=2.5, alpha=0.6, hue="candidate",
                  hue_order=names, legend=False, palette="colorblind")
    ax.set_xscale("log")
    ax.set_xlabel("per-token latency (ms, log scale)")
    ax.set_ylabel("")


def plot_tok_s(measured: Mapping[str, float], ceilings: Mapping[str, float], ax, ylabel: str = "tokens/s") -> None:
    """Bars of measured tokens/s with each candidate's roofline ceiling drawn over its bar."""
    names = list(measured)
    positions = range(len(names))
    ax.bar(positions, [measured[n] for n in names], color="#0173b2", label="measured")
    for pos, name in zip(positions, names):
        if name in ceilings:
            ax.hlines(ceilings[name], pos - 0.4, pos + 0.4, colors="#de8f05", linestyles="--", linewidth=2,
                      label="bandwidth ceiling" if pos == 0 else None)
    ax.set_xticks(list(positions), names, rotation=20, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.legend(loc="upper left", fontsize=9)


def plot_usd_per_m(table: pd.DataFrame, ax, reference_usd: float | None = None, reference_label: str = "") -> None:
    """Horizontal bars: predicted $ per million tokens per deployment, dense vs sparse experts (log scale)."""
    import seaborn as sns

    priced = table.dropna(subset=["usd_per_m_tokens"])
    sns.barplot(data=priced, y="deployment", x="usd_per_m_tokens", hue="experts", ax=ax, palette="colorblind")
    for container in ax.containers:
        ax.bar_label(container, fmt="$%.2f", fontsize=9, padding=2)
    ax.set_xlabel("$ per million tokens (one stream, batch 1, at the bandwidth roofline)")
    ax.set_ylabel("")
    _reference_in_legend(ax, reference_usd, reference_label)


def plot_roofline_tok_s(table: pd.DataFrame, ax, reference_tok_s: float | None = None, reference_label: str = "") -> None:
    """Horizontal bars: predicted tokens/s per deployment, dense vs sparse experts (log scale)."""
    import seaborn as sns

    sns.barplot(data=table, y="deployment", x="tok_s", hue="experts", ax=ax, palette="colorblind")
    for container in ax.containers:
        ax.bar_label(container, fmt="%.0f", fontsize=9, padding=2)
    ax.set_xscale("log")
    ax.set_xlabel("tokens/s, batch 1, bandwidth roofline (log scale)")
    ax.set_ylabel("")
    _reference_in_legend(ax, reference_tok_s, reference_label)


def _reference_in_legend(ax, value: float | None, label: str) -> None:
    """A dashed vertical line at the story's figure, named in the legend (a label on the line would sit on the bars).

    The legend goes outside the axes, on the right: inside, it would cover the longest bars' labels.
    """
    if value is not None:
        ax.axvline(value, color="0.25", linestyle="--", linewidth=1.2, label=label)
    ax.legend(title="experts", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
