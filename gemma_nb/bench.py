"""Decode benchmarks, measured (notebook 07): step and generation timings, memory bandwidth, the
sparse step's breakdown. The modelled side (the roofline) is ``gemma_nb.decode_roofline``."""

import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import matplotlib.ticker
import pandas as pd
import seaborn as sns
import torch
from transformers import DynamicCache, Gemma4ForCausalLM

from gemma_nb.hardware import GB

EXPERT_MODES = ("dense", "sparse")
TIMING_ENV = "GEMMA_NB_TIMING"


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def check_counts(**counts: int) -> None:
    for name, value in counts.items():
        minimum, why = {
            "warmup": (0, ""),
            "new_tokens": (2, " (one first token, then decode steps)"),
            "batch": (1, " (streams decoded together)"),
        }.get(name, (1, ""))
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}={value!r} must be an integer >= {minimum}{why}")


def smoke_timing() -> bool:
    """True under ``GEMMA_NB_TIMING=smoke`` (timing loops run once); ``full`` or unset: as asked."""
    mode = os.environ.get(TIMING_ENV, "full")
    if mode not in ("full", "smoke"):
        raise ValueError(
            f"{TIMING_ENV}={mode!r} is not one of full, smoke (unset it for a real measurement)"
        )
    return mode == "smoke"


def _rotated(names: Sequence[str], shift: int) -> list[str]:
    return [names[(i + shift) % len(names)] for i in range(len(names))]


@dataclass
class Timings:
    """Per-step latencies (``steps``: candidate, repeat, step, ms) of candidates timed side by side;
    generation adds ``first_token`` (candidate, repeat, ttft_ms) and ``tokens`` (candidate -> [1, S
    + n])."""

    steps: pd.DataFrame
    first_token: pd.DataFrame | None = None
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def candidates(self) -> list[str]:
        return list(dict.fromkeys(self.steps["candidate"]))

    def _ms(self, name: str) -> pd.Series:
        assert name in self.candidates, f"candidate {name!r} was not timed"
        return self.steps.loc[self.steps["candidate"] == name, "ms"]

    def summary(self) -> pd.DataFrame:
        """One row per candidate: step latency percentiles (ms, all repeats), tok/s (median and
        range over repeats), and for generation ``ttft_ms`` (median over repeats)."""
        rows = []
        per_repeat = self.steps.groupby(["candidate", "repeat"], sort=False)["ms"].agg(
            total_ms="sum", steps="count"
        )
        per_repeat = per_repeat.reset_index().assign(
            tok_s=lambda t: 1000.0 * t["steps"] / t["total_ms"]
        )
        for name in self.candidates:
            ms = self._ms(name)
            tok_s = per_repeat.loc[per_repeat["candidate"] == name, "tok_s"]
            row = {
                "candidate": name,
                "p50_ms": ms.median(),
                "p90_ms": ms.quantile(0.9),
                "mean_ms": ms.mean(),
                "min_ms": ms.min(),
                "tok_s": tok_s.median(),
                "tok_s_min": tok_s.min(),
                "tok_s_max": tok_s.max(),
                "repeats": tok_s.size,
                "steps_per_repeat": ms.size // tok_s.size,
            }
            if self.first_token is not None:
                row["ttft_ms"] = self.first_token.loc[
                    self.first_token["candidate"] == name, "ttft_ms"
                ].median()
            rows.append(row)
        return pd.DataFrame(rows).set_index("candidate")

    def ratio(self, numerator: str, denominator: str) -> float:
        """Median over rounds (one step of every candidate, back to back) of numerator's step time
        over denominator's: > 1 means ``numerator`` is slower; pairing steps moments apart cancels
        drift."""
        self._ms(numerator), self._ms(denominator)  # both were timed
        table = self.steps.pivot_table(index=["repeat", "step"], columns="candidate", values="ms")
        return float((table[numerator] / table[denominator]).median())

    def p50_ms(self, name: str) -> float:
        return float(self._ms(name).median())

    # the fastest step: what the machine allows when nothing else interferes
    def min_ms(self, name: str) -> float:
        return float(self._ms(name).min())


def time_steps(
    candidates: Mapping[str, Callable[[int], Any]],
    steps: int = 16,
    repeats: int = 5,
    warmup: int = 2,
    device: str = "cpu",
) -> Timings:
    """Time one-token steps of each candidate (name -> ``fn(i)``, ``i`` its call count), after
    ``warmup`` untimed steps: per repeat, ``steps`` rounds of one step each, in an order rotating
    each round."""
    check_counts(steps=steps, repeats=repeats, warmup=warmup)
    assert candidates, "no candidates"
    if smoke_timing():
        steps, repeats, warmup = 1, 1, 0
    names = list(candidates)
    calls = dict.fromkeys(names, warmup)  # a candidate's next call count
    with torch.inference_mode():
        for name in names:
            for i in range(warmup):
                candidates[name](i)
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


def _generate_timed(
    model, input_ids: torch.Tensor, new_tokens: int, device: str
) -> tuple[float, list[float], torch.Tensor]:
    """Greedy generation with a KV cache: (ttft_ms, per-token decode ms, tokens [1, S +
    new_tokens])."""
    # a function returning it: called untimed
    model = model if isinstance(model, torch.nn.Module) else model()
    cache = DynamicCache(config=model.config)
    _sync(device)
    token, generated, ms = input_ids, [], []
    for _ in range(new_tokens):
        start = time.perf_counter()
        logits = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
        _sync(device)
        ms.append(1000.0 * (time.perf_counter() - start))
        generated.append(token)
    return ms[0], ms[1:], torch.cat([input_ids, *generated], dim=1)


def time_generation(
    models: Mapping[str, Any],
    input_ids,
    new_tokens: int = 32,
    repeats: int = 3,
    warmup: int = 1,
    device: str = "cpu",
) -> Timings:
    """Greedy generation of ``new_tokens`` by each model (or a function returning it, called untimed
    before each run), interleaved across repeats: TTFT, then the decode steps. Tokens that change
    between repeats are an error."""
    check_counts(new_tokens=new_tokens, repeats=repeats, warmup=warmup)
    if smoke_timing():
        repeats, warmup = 1, 0
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    ids = (ids[None] if ids.dim() == 1 else ids).to(device)
    assert ids.dim() == 2 and ids.shape[0] == 1, (
        f"input_ids {tuple(ids.shape)}: one prompt [S] or [1, S]"
    )
    steps, firsts, tokens = [], [], {}
    with torch.inference_mode():
        for model in models.values():
            for _ in range(warmup):
                _generate_timed(model, ids, min(new_tokens, 4), device)
        for repeat in range(repeats):
            for name in _rotated(list(models), repeat):
                ttft, decode, out = _generate_timed(models[name], ids, new_tokens, device)
                if name in tokens and not torch.equal(tokens[name], out.cpu()):
                    raise ValueError(
                        f"candidate {name!r} generated different tokens in repeat {repeat}"
                    )
                tokens[name] = out.cpu()
                firsts.append((name, repeat, ttft))
                steps += [(name, repeat, step, ms) for step, ms in enumerate(decode)]
    return Timings(
        pd.DataFrame(steps, columns=["candidate", "repeat", "step", "ms"]),
        pd.DataFrame(firsts, columns=["candidate", "repeat", "ttft_ms"]),
        tokens,
    )


def time_runners(
    runners: Mapping[str, Any], input_ids, new_tokens: int = 32, repeats: int = 3
) -> pd.DataFrame:
    """Median TTFT (``generate(ids, 1)``), decode tok/s and tokens per runner exposing only
    ``generate(ids, max_new_tokens)``."""
    check_counts(new_tokens=new_tokens, repeats=repeats)
    repeats = 1 if smoke_timing() else repeats
    rows = []
    for repeat in range(repeats):
        for name in _rotated(list(runners), repeat):
            start = time.perf_counter()
            runners[name].generate(input_ids, 1)
            ttft_s = time.perf_counter() - start
            start = time.perf_counter()
            tokens = runners[name].generate(input_ids, new_tokens)
            total_s = time.perf_counter() - start
            rows.append(
                {
                    "runner": name,
                    "repeat": repeat,
                    "ttft_s": ttft_s,
                    "decode_tok_s": (new_tokens - 1) / max(total_s - ttft_s, 1e-9),
                    "tokens": torch.as_tensor(tokens)[0].tolist(),
                }
            )
    return (
        pd.DataFrame(rows)
        .groupby("runner", sort=False)
        .agg(
            ttft_s=("ttft_s", "median"),
            decode_tok_s=("decode_tok_s", "median"),
            tokens=("tokens", "last"),
        )
    )


def random_model_on_device(
    config, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0
):
    """A random-weight ``Gemma4ForCausalLM`` built directly on ``device`` (the 26B never touches
    host RAM)."""
    torch.manual_seed(seed)
    with torch.device(device):
        return Gemma4ForCausalLM._from_config(config, dtype=dtype).eval()


def measure_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5, device: str = "cpu") -> dict:
    """Read (``sum``) and copy GB/s over an fp32 buffer of ``nbytes``: best of ``repeats`` (STREAM's
    convention) and median. fp32, since a bf16 ``sum`` converts each element first and is bound by
    that on one AVX2 core (~15 GB/s where fp32 reads ~20)."""
    check_counts(repeats=repeats)
    repeats = 1 if smoke_timing() else repeats
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 2**20:
        raise ValueError(
            f"nbytes={nbytes!r} must be an integer >= 1 MiB (use >= 256 MiB to defeat caches)"
        )
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
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
    moved = {"read": src.nbytes, "copy": 2 * src.nbytes}
    return {
        "nbytes": src.nbytes,
        "device": str(device),
        **{
            f"{kind}_gb_s{suffix}": moved[kind] / statistic(seconds) / GB
            for kind, seconds in timings.items()
            for suffix, statistic in (("", min), ("_median", statistics.median))
        },
    }


def floor_ms(nbytes: float, bandwidth_bytes_s: float) -> float:
    """The shortest time (ms) in which ``nbytes`` can be read at ``bandwidth_bytes_s``."""
    assert bandwidth_bytes_s and bandwidth_bytes_s > 0, f"bandwidth_bytes_s={bandwidth_bytes_s!r}"
    return 1000.0 * nbytes / bandwidth_bytes_s


def layer_steps(
    modules: Mapping[str, Callable],
    hidden_states: torch.Tensor,
    routes: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, Callable[[int], Any]]:
    """``time_steps`` candidates: step i runs ``module(hidden_states, *routes[i % len(routes)])``, a
    fresh routing each step."""
    assert routes, "no routes"
    return {
        name: (lambda i, m=module: m(hidden_states, *routes[i % len(routes)]))
        for name, module in modules.items()
    }


def sparse_breakdown_steps(
    module,
    tiny_module,
    hidden_states: torch.Tensor,
    tiny_hidden_states: torch.Tensor,
    routes,
    prefix: str,
    gather: bool = True,
) -> dict[str, Callable[[int], Any]]:
    """A sparse step as candidates: ``<prefix>:kernel`` (the 2 K matmuls alone),
    ``<prefix>:overhead`` (the layer at tiny width: dispatch, routing, combine), with ``gather``
    ``<prefix>:gather_copy`` (what the ``gather`` kernel adds)."""
    ids = [route[0][0].tolist() for route in routes]
    x = hidden_states[:1].contiguous()
    inter = torch.zeros(len(ids[0]), module.intermediate_dim, dtype=x.dtype, device=x.device)

    def kernel(i):
        module.linear_each(x, "gate_up", ids[i % len(ids)])
        module.linear_each(inter, "down", ids[i % len(ids)])

    steps = {
        f"{prefix}:kernel": kernel,
        f"{prefix}:overhead": lambda i: tiny_module(tiny_hidden_states, *routes[i % len(routes)]),
    }
    if gather:
        steps[f"{prefix}:gather_copy"] = lambda i: (
            module.gate_up_proj[routes[i % len(routes)][0][0]],
            module.down_proj[routes[i % len(routes)][0][0]],
        )
    return steps


def breakdown_table(
    timings: Timings,
    prefixes: Sequence[str],
    weight_bytes: Mapping[str, float],
    bandwidth_bytes_s: float,
) -> pd.DataFrame:
    """Per sparse candidate (``weight_bytes``: prefix -> bytes a step reads): its p50 and fastest
    step against its bandwidth floor, and the parts ``sparse_breakdown_steps`` timed beside it
    (ms)."""
    rows = []
    for prefix in prefixes:
        floor = floor_ms(weight_bytes[prefix], bandwidth_bytes_s)
        step, kernel, overhead = (
            timings.p50_ms(name) for name in (prefix, f"{prefix}:kernel", f"{prefix}:overhead")
        )
        gather = (
            timings.p50_ms(f"{prefix}:gather_copy")
            if f"{prefix}:gather_copy" in timings.candidates
            else float("nan")
        )
        rows.append(
            {
                "candidate": prefix,
                "floor_ms": floor,
                "step_ms": step,
                "x_floor": step / floor,
                "best_step_ms": timings.min_ms(prefix),
                "best_x_floor": timings.min_ms(prefix) / floor,
                "kernel_ms": kernel,
                "kernel_gb_s": weight_bytes[prefix] / kernel / 1e6,
                "overhead_ms": overhead,
                "kernel_plus_overhead_ms": kernel + overhead,
                "gather_copy_ms": gather,
            }
        )
    return pd.DataFrame(rows).set_index("candidate")


def plot_latency(timings: Timings, ax, candidates: Sequence[str] | None = None) -> None:
    """Per-step latency of each candidate (ms, log scale): box + points, all repeats pooled."""
    names = list(candidates or timings.candidates)
    data = timings.steps[timings.steps["candidate"].isin(names)]
    axes = dict(data=data, x="ms", y="candidate", order=names, ax=ax)
    sns.boxplot(**axes, color="0.85", fliersize=0, linewidth=0.8)
    sns.stripplot(
        **axes,
        size=2.5,
        alpha=0.6,
        hue="candidate",
        hue_order=names,
        legend=False,
        palette="colorblind",
    )
    ax.set(xscale="log", xlabel="per-token latency (ms, log scale)", ylabel="")
    # a narrow span labels minor ticks, which collide
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def plot_tok_s(
    measured: Mapping[str, float], ceilings: Mapping[str, float], ax, ylabel: str = "tokens/s"
) -> None:
    """Bars of measured tokens/s with each candidate's roofline ceiling drawn over its bar."""
    names = list(measured)
    positions = range(len(names))
    ax.bar(positions, [measured[n] for n in names], color="#0173b2", label="measured")
    for pos, name in zip(positions, names):
        if name in ceilings:
            ax.hlines(
                ceilings[name],
                pos - 0.4,
                pos + 0.4,
                colors="#de8f05",
                linestyles="--",
                linewidth=2,
                label="bandwidth ceiling" if pos == 0 else None,
            )
    ax.set_xticks(list(positions), names, rotation=30, ha="right")
    # a decade of headroom above the tallest bar or ceiling keeps the legend off the bars
    ax.set(
        yscale="log", ylabel=ylabel, ylim=(None, 10 * max(*measured.values(), *ceilings.values()))
    )
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(loc="upper left", fontsize=9)
