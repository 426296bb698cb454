"""Notebook 03 (lm_head sharding): the tied head in int8, split by vocab rows over ranks under real
``torch.distributed`` (shards aligned to ``ALIGN_ROWS``, the last padded with ``-inf`` logits), and
the jobs ``gemma_nb.ranks.run_tp`` starts."""

import ctypes
import ctypes.util
import functools
import gc
import math
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import pandas as pd
import psutil
import torch
import torch.distributed as dist
from torch import nn

from gemma_nb import plots
from gemma_nb.formats import int8_matmul, quantize_int8_per_channel
from gemma_nb.story import CLAIMS

ALIGN_ROWS = 64  # each rank's first row a multiple of 64
DEFAULT_CHUNK_ROWS = 8192  # rows quantized at once: bounds the fp32 temporary to ~100 MB at H=2816
SEEDED_BLOCK_ROWS = 4096  # rows per block of the seeded generator


class VocabShard(NamedTuple):
    """The vocab rows one rank holds: real rows ``start:stop``, then ``pad_rows`` of padding
    (``rows_per_rank`` in all)."""

    vocab_size: int
    tp: int
    rank: int
    rows_per_rank: int
    start: int
    stop: int
    real_rows: int
    pad_rows: int


def vocab_shard(vocab_size: int, tp: int, rank: int) -> VocabShard:
    """Rank ``rank``'s rows: the vocab rounded up to a multiple of ``tp * ALIGN_ROWS``, split in
    ``tp``."""
    for name, value in (("vocab_size", vocab_size), ("tp", tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    assert isinstance(rank, int) and 0 <= rank < tp, (
        f"rank={rank!r} must be an integer in [0, tp={tp})"
    )
    unit = tp * ALIGN_ROWS
    rows = math.ceil(vocab_size / unit) * unit // tp
    start, stop = min(rank * rows, vocab_size), min((rank + 1) * rows, vocab_size)
    return VocabShard(vocab_size, tp, rank, rows, start, stop, stop - start, rows - (stop - start))


def seeded_rows(seed: int, start: int, stop: int, hidden_size: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a bf16 normal(0, 0.02) table fixed by ``seed``, the same however
    they are asked for (one generator per ``SEEDED_BLOCK_ROWS`` block): a rank builds its own rows,
    never the whole fp32 table."""
    assert 0 <= start <= stop, (start, stop)
    out = torch.empty(stop - start, hidden_size, dtype=torch.bfloat16)
    for block in range(start // SEEDED_BLOCK_ROWS, -(-stop // SEEDED_BLOCK_ROWS)):
        lo = block * SEEDED_BLOCK_ROWS
        generator = torch.Generator().manual_seed(seed * 1_000_003 + block)
        values = torch.randn(SEEDED_BLOCK_ROWS, hidden_size, generator=generator).mul_(0.02)
        a, b = max(lo, start), min(lo + SEEDED_BLOCK_ROWS, stop)
        out[a - start : b - start] = values[a - lo : b - lo].to(torch.bfloat16)
    return out


def quantize_rows(
    rows_fn: Callable[[int, int], torch.Tensor],
    start: int,
    stop: int,
    hidden_size: int,
    out_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows and fp32 scales of rows ``[start, stop)`` read in chunks through ``rows_fn(a, b)``,
    padded to ``out_rows``."""
    out_rows = stop - start if out_rows is None else out_rows
    q = torch.zeros(out_rows, hidden_size, dtype=torch.int8)
    scale = torch.zeros(out_rows, 1, dtype=torch.float32)
    for a in range(start, stop, DEFAULT_CHUNK_ROWS):
        b = min(a + DEFAULT_CHUNK_ROWS, stop)
        rows = rows_fn(a, b)
        assert tuple(rows.shape) == (b - a, hidden_size), (a, b, rows.shape)
        # fp32 in: the same numbers (the quantizer upcasts anyway), fewer slow bf16 kernels on CPUs
        # without bf16
        q[a - start : b - start], scale[a - start : b - start] = quantize_int8_per_channel(
            rows.float(), name=f"rows[{a}:{b}]"
        )
    return q, scale


class VocabParallelLMHead(nn.Module):
    """One rank's int8 rows of the lm_head (bf16 matmul), all-gathered into full logits (NxD's
    ``gather_output=True``)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, shard: VocabShard):
        super().__init__()
        if shard.tp > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(
                    f"a VocabParallelLMHead with tp={shard.tp} needs torch.distributed "
                    f"initialised with world size {shard.tp}: build it inside a worker started "
                    "by gemma_nb.ranks.run_tp (or use tp=1)"
                )
            assert (dist.get_world_size(), dist.get_rank()) == (shard.tp, shard.rank), (
                "one shard per rank"
            )
        self.shard = shard
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float())

    @classmethod
    def from_rows(
        cls,
        rows_fn: Callable[[int, int], torch.Tensor],
        vocab_size: int,
        hidden_size: int,
        tp: int,
        rank: int,
    ) -> "VocabParallelLMHead":
        """Rank ``rank``'s shard, reading only its own rows through ``rows_fn(a, b)``."""
        shard = vocab_shard(vocab_size, tp, rank)
        return cls(
            *quantize_rows(
                rows_fn, shard.start, shard.stop, hidden_size, out_rows=shard.rows_per_rank
            ),
            shard,
        )

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds: int8 rows (padding included) + fp32 scales."""
        return self.qweight.nbytes + self.scale.nbytes

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's logits ``[..., rows_per_rank]`` (``gather_output=False``); padding columns
        ``-inf``."""
        n = self.shard.real_rows
        logits = int8_matmul(hidden.to(torch.bfloat16), self.qweight[:n], self.scale[:n])
        if self.shard.pad_rows:
            pad = logits.new_full((*logits.shape[:-1], self.shard.pad_rows), float("-inf"))
            logits = torch.cat([logits, pad], dim=-1)
        return logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.local_logits(hidden).contiguous()
        if self.shard.tp > 1:
            parts = [torch.empty_like(local) for _ in range(self.shard.tp)]
            dist.all_gather(parts, local)
            local = torch.cat(parts, dim=-1)
        return local[..., : self.shard.vocab_size]


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma's final softcap ``cap * tanh(logits / cap)`` (None: unchanged), in the order
    transformers applies it."""
    if cap is None:
        return logits
    if not cap > 0:
        raise ValueError(f"softcap {cap!r} must be positive (Gemma-4 uses 30.0) or None")
    return torch.tanh(logits / cap) * cap


def bf16_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The replicated bf16 head the port started from: ``hidden.bf16 @ weight.bf16.T``, bf16
    logits."""
    return torch.nn.functional.linear(hidden.to(torch.bfloat16), weight.to(torch.bfloat16))


def _rss_bytes() -> int:
    """This process's RSS after handing freed heap back to the OS (glibc's ``malloc_trim``)."""
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)
    return psutil.Process().memory_info().rss


def lm_head_job(rank: int, world_size: int, weight: torch.Tensor, hidden: torch.Tensor) -> dict:
    """One rank: quantize its rows of ``weight [V, H]``, return its shard facts and the gathered
    logits."""
    head = VocabParallelLMHead.from_rows(
        lambda a, b: weight[a:b].detach(), *weight.shape, tp=world_size, rank=rank
    )
    with torch.inference_mode():
        logits = head(hidden)
    s = head.shard
    return {
        "rank": rank,
        "start": s.start,
        "stop": s.stop,
        "pad_rows": s.pad_rows,
        "shard_bytes": head.nbytes,
        "logits": logits,
    }


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median ms of ``fn`` over ``repeats`` calls, the ranks started together by a barrier each
    time."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def full_size_job(
    rank: int,
    world_size: int,
    seed: int,
    vocab_size: int,
    hidden_size: int,
    hidden: torch.Tensor,
    repeats: int = 5,
) -> dict:
    """One rank at the real size: the replicated bf16 head, then its int8 shard of its seeded rows
    (bytes, RSS, ms, logits)."""
    with torch.inference_mode():
        rss0 = _rss_bytes()
        replicated = seeded_rows(seed, 0, vocab_size, hidden_size)
        rss1 = _rss_bytes()
        replicated_bytes = replicated.nbytes
        token = hidden[:1]
        bf16_ms = _median_ms(
            functools.partial(bf16_head_logits, token, replicated), max(1, repeats // 2)
        )
        del replicated
        gc.collect()
        rss2 = _rss_bytes()
        head = VocabParallelLMHead.from_rows(
            lambda a, b: seeded_rows(seed, a, b, hidden_size),
            vocab_size,
            hidden_size,
            tp=world_size,
            rank=rank,
        )
        rss3 = _rss_bytes()
        logits = head(hidden)
        gathered_ms = _median_ms(lambda: head(token), repeats)
    s = head.shard
    return {
        "rank": rank,
        "start": s.start,
        "stop": s.stop,
        "replicated_bf16_bytes": replicated_bytes,
        "replicated_bf16_rss_growth": rss1 - rss0,
        "shard_weight_bytes": head.qweight.nbytes,
        "shard_scale_bytes": head.scale.nbytes,
        "shard_bytes": head.nbytes,
        "shard_rss_growth": rss3 - rss2,
        "replicated_bf16_ms_per_token": bf16_ms,
        "gathered_int8_ms_per_token": gathered_ms,
        "logits": logits,
    }


def logits_agreement(reference: torch.Tensor, candidate: torch.Tensor) -> dict:
    """Bit-exactness, argmax identity, top-1 agreement and max |difference| of two logit tensors
    [..., V]."""
    assert reference.shape == candidate.shape, (reference.shape, candidate.shape)
    ref_top, cand_top = reference.argmax(-1), candidate.argmax(-1)
    return {
        "bit_exact": bool(torch.equal(reference, candidate)),
        "argmax_identical": bool(torch.equal(ref_top, cand_top)),
        "top1_agreement": float((ref_top == cand_top).float().mean()),
        "max_abs_diff": float((reference.float() - candidate.float()).abs().max()),
        "positions": int(ref_top.numel()),
    }


@torch.no_grad()
def head_inputs(
    model, input_ids_batches: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [N, H]`` (the final-norm output a Gemma-4 feeds its lm_head) and its softcapped
    ``logits [N, V]``."""
    hidden = [
        model.model(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size)
        for ids in input_ids_batches
    ]
    logits = [
        model(input_ids=ids, use_cache=False).logits.reshape(-1, model.config.vocab_size)
        for ids in input_ids_batches
    ]
    return torch.cat(hidden), torch.cat(logits)


def bytes_table(results: Sequence[dict], host_embedding: torch.Tensor) -> pd.DataFrame:
    """Each copy of the tied table before and after: state, holder, copy, dtype, bytes, gb."""
    host = {
        "holder": "host",
        "copy": "embedding table (lookup)",
        "dtype": str(host_embedding.dtype).replace("torch.", ""),
        "bytes": host_embedding.nbytes,
    }
    rows = [{"state": "before", **host}]
    rows += [
        {
            "state": "before",
            "holder": f"rank {r['rank']}",
            "copy": "lm_head, replicated",
            "dtype": "bfloat16",
            "bytes": r["replicated_bf16_bytes"],
        }
        for r in results
    ]
    rows.append({"state": "after", **host})
    rows += [
        {
            "state": "after",
            "holder": f"rank {r['rank']}",
            "copy": f"lm_head rows [{r['start']}, {r['stop']})",
            "dtype": "int8 + fp32 scale",
            "bytes": r["shard_bytes"],
        }
        for r in results
    ]
    return pd.DataFrame(rows).assign(gb=lambda table: table["bytes"] / 1e9)


def plot_bytes_per_holder(table):
    """Stacked GB bars, before and after (host table, each rank's head), with the story's per-rank
    figures."""
    fig, ax = plots.subplots(figsize=(7.5, 4.6))
    part = table["copy"].str.startswith("lm_head").map({False: "embedding", True: "lm_head"})
    # before, then after; holders in order
    held = table.assign(part=part).pivot_table(
        index=["state", "holder"],
        columns="part",
        values="gb",
        aggfunc="sum",
        fill_value=0.0,
        sort=False,
    )
    labels = [f"{holder}\n{state}" for state, holder in held.index]
    embed_gb, head_gb = held["embedding"].tolist(), held["lm_head"].tolist()
    # a gap between before and after
    x = [i + (0.6 if i >= len(labels) // 2 else 0.0) for i in range(len(labels))]
    _ = ax.bar(x, embed_gb, label="embedding table (host, bf16)")
    _ = ax.bar(x, head_gb, bottom=embed_gb, label="lm_head (on each rank)")
    ax.set(
        xticks=x,
        xticklabels=labels,
        ylim=(0, 1.15 * max(e + h for e, h in zip(embed_gb, head_gb))),
        ylabel="bytes held (GB)",
        title="Tied table: replicated bf16 head vs int8 head sharded over 2 ranks",
    )
    heads = {
        "lm_head_bf16_gb_per_rank": ("bf16 head", "--"),
        "lm_head_int8_sharded_gb_per_rank": ("int8 sharded head", ":"),
    }
    for key, (what, style) in heads.items():
        value = CLAIMS[key].value
        label = f"story: {what} {value:g} GB/rank"
        _ = ax.axhline(value, color="0.25", linestyle=style, linewidth=1.2, label=label)
    _ = ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False, fontsize=9)
    return fig


def shard_plan(vocab_size: int, tp: int) -> pd.DataFrame:
    """Which rows each rank holds (one row per rank): start, stop, real rows, padding rows."""
    shards = pd.DataFrame([vocab_shard(vocab_size, tp, r) for r in range(tp)])
    return shards[["rank", "start", "stop", "real_rows", "pad_rows", "rows_per_rank"]]


def with_head(model, head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``input_ids -> logits``: ``model``'s body, then ``head``, then the host softcap (for
    ``gemma_nb.evaluate``)."""
    cap = getattr(model.config, "final_logit_softcapping", None)

    @torch.no_grad()
    def logits_fn(input_ids: torch.Tensor) -> torch.Tensor:
        return softcap_logits(head(model.model(input_ids=input_ids).last_hidden_state).float(), cap)

    return logits_fn
