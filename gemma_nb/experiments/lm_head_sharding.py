"""The tied lm_head sharded over tensor-parallel ranks, under real ``torch.distributed`` (03).

The port's fix: the tied lm_head ``[vocab, hidden]`` was replicated in bf16 on both NeuronCores
(1.48 GB each). Quantized to int8 per output row and split by vocab rows across the two ranks
(NxD ``QuantizedColumnParallel(gather_output=True)``), each rank holds a quarter of those bytes.

Vocab-parallel = column-parallel over the vocab: rank ``r`` holds rows
``[r * rows_per_rank, (r + 1) * rows_per_rank)`` of the head as int8 plus one fp32 scale per row,
computes the logits of those rows, and an all-gather gives every rank the full logits. A logit is
one row's dot product with the hidden state, so a rank computes exactly what the unsharded head
computes for that row: the gathered logits are *bit-identical* to the unsharded int8 head's
(``gemma_nb.quant.Int8Linear``), provided the matmul kernel reduces a column the same way wherever
it sits and however many threads run it. The head computes in bf16 by default, as the port did
(``dtype=torch.bfloat16``); torch's CPU bf16 matmul meets that condition for every split and
thread count tried here. fp32 does not, on this x86 box (MKL): with more than one token the result
depends on the thread count, and a column's last bits depend on whether it falls in a vector
block or the scalar tail, so a split at row 501 of 1001 differs by ~1 ulp. Shards therefore start
at multiples of ``align_rows`` (64) rows, which keeps the fp32 columns in place too.

Vocab not divisible: **pad and mask**, like NxD's ``pad=True``. ``rows_per_rank`` is the vocab
rounded up to a multiple of ``tp * align_rows``, divided by ``tp``; the last rank's missing rows
are zero int8 rows with zero scales (every rank holds the same shape, as SPMD needs), their
logits are never computed but filled with ``-inf`` (so a rank-local argmax or softmax can never
pick a padding token), and the gathered logits are trimmed back to ``vocab_size`` columns.

Processes: ``gemma_nb.ranks.run_tp`` starts the ranks (real processes, gloo on 127.0.0.1); the
jobs notebook 03 runs on them (``lm_head_job``, ``full_size_job``) live here, importable by name.

The final logit softcapping ``30 * tanh(x / 30)`` is *not* part of the head: the port applied it
on the host after the gather, outside the compiled graph (:func:`softcap_logits`).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from gemma_nb import plots
from gemma_nb.formats import int8_matmul, quantize_int8_per_channel
from gemma_nb.story import CLAIMS

DEFAULT_ALIGN_ROWS = 64
# Rows quantized at once while building a shard: bounds the fp32 temporary to ~100 MB at H=2816.
DEFAULT_CHUNK_ROWS = 8192
# Rows per block of the seeded generator: any row range is rebuilt from whole blocks.
SEEDED_BLOCK_ROWS = 4096
SOFTCAP = 30.0


# --- which rows a rank holds -----------------------------------------------------------------


@dataclass(frozen=True)
class VocabShard:
    """The vocab rows one rank holds. ``rows_per_rank`` includes padding; ``start:stop`` are real rows."""

    vocab_size: int
    tp: int
    rank: int
    rows_per_rank: int

    @property
    def padded_vocab(self) -> int:
        return self.rows_per_rank * self.tp

    @property
    def start(self) -> int:
        return min(self.rank * self.rows_per_rank, self.vocab_size)

    @property
    def stop(self) -> int:
        return min((self.rank + 1) * self.rows_per_rank, self.vocab_size)

    @property
    def real_rows(self) -> int:
        return self.stop - self.start

    @property
    def pad_rows(self) -> int:
        return self.rows_per_rank - self.real_rows


def vocab_shard(vocab_size: int, tp: int, rank: int, align_rows: int = DEFAULT_ALIGN_ROWS) -> VocabShard:
    """Rows of a ``vocab_size``-row head held by ``rank`` of ``tp``, padded as the module docstring says."""
    for name, value, low in (("vocab_size", vocab_size, 1), ("tp", tp, 1), ("align_rows", align_rows, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    if not isinstance(rank, int) or not 0 <= rank < tp:
        raise ValueError(f"rank={rank!r} must be an integer in [0, tp={tp})")
    unit = tp * align_rows
    padded = math.ceil(vocab_size / unit) * unit
    return VocabShard(vocab_size=vocab_size, tp=tp, rank=rank, rows_per_rank=padded // tp)


# --- deterministic full-size tables without a full-size temporary ------------------------------


def seeded_rows(seed: int, start: int, stop: int, hidden_size: int, std: float = 0.02,
                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows ``[start, stop)`` of a random ``[vocab, hidden]`` table fixed by ``seed``, as ``dtype``.

    The table is generated in blocks of ``SEEDED_BLOCK_ROWS`` rows, each from its own generator, so
    any row range comes out identical however it is requested: a rank builds only its own rows and
    the host builds the whole table chunk by chunk, never holding the fp32 table (2.95 GB at full
    size). Values are normal with standard deviation ``std``, rounded once to ``dtype`` (bf16: the
    checkpoint's storage dtype, which the int8 quantizer then reads).
    """
    if not 0 <= start <= stop:
        raise ValueError(f"row range [{start}, {stop}) is empty or reversed; expected 0 <= start <= stop")
    out = torch.empty(stop - start, hidden_size, dtype=dtype)
    block = start // SEEDED_BLOCK_ROWS
    while block * SEEDED_BLOCK_ROWS < stop:
        lo = block * SEEDED_BLOCK_ROWS
        generator = torch.Generator().manual_seed(seed * 1_000_003 + block)
        values = torch.randn(SEEDED_BLOCK_ROWS, hidden_size, generator=generator).mul_(std)
        a, b = max(lo, start), min(lo + SEEDED_BLOCK_ROWS, stop)
        out[a - start:b - start] = values[a - lo:b - lo].to(dtype)
        block += 1
    return out


def seeded_table(seed: int, vocab_size: int, hidden_size: int, std: float = 0.02,
                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The whole table of :func:`seeded_rows`, allocated once in ``dtype`` and filled block by block."""
    return seeded_rows(seed, 0, vocab_size, hidden_size, std=std, dtype=dtype)


def quantize_rows(rows_fn: Callable[[int, int], torch.Tensor], start: int, stop: int, hidden_size: int,
                  out_rows: int | None = None, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows ``[start, stop)`` of a table read through ``rows_fn(a, b) -> [b - a, hidden]``.

    Quantized chunk by chunk with ``gemma_nb.formats.quantize_int8_per_channel`` (per row, so chunking
    changes nothing) into preallocated ``q int8 [out_rows, hidden]`` and ``scale fp32 [out_rows, 1]``;
    rows past ``stop - start`` (padding) stay zero.
    """
    out_rows = stop - start if out_rows is None else out_rows
    if out_rows < stop - start:
        raise ValueError(f"out_rows={out_rows} is smaller than the {stop - start} rows asked for")
    q = torch.zeros(out_rows, hidden_size, dtype=torch.int8)
    scale = torch.zeros(out_rows, 1, dtype=torch.float32)
    for a in range(start, stop, chunk_rows):
        b = min(a + chunk_rows, stop)
        rows = rows_fn(a, b)
        if tuple(rows.shape) != (b - a, hidden_size):
            raise ValueError(f"rows_fn({a}, {b}) returned shape {tuple(rows.shape)}; expected {(b - a, hidden_size)}")
        # fp32 in, same numbers (the quantizer upcasts anyway), fewer slow bf16 kernels on CPUs without bf16.
        q[a - start:b - start], scale[a - start:b - start] = quantize_int8_per_channel(rows.float(), name=f"rows[{a}:{b}]")
    return q, scale


# --- the head ----------------------------------------------------------------------------------


class VocabParallelLMHead(nn.Module):
    """One rank's slice of an int8 lm_head, gathered into full logits (``gather_output=True``).

    Buffers: ``qweight int8 [rows_per_rank, hidden]`` and ``scale fp32 [rows_per_rank, 1]`` (padding
    rows zero). ``forward(hidden [..., H]) -> logits [..., vocab_size]`` in ``hidden.dtype``: the
    local logits of this rank's real rows through ``gemma_nb.formats.int8_matmul`` (NxD's order:
    upcast the int8 weight to the activation dtype, matmul, times the fp32 scale), padding columns
    ``-inf``, all-gathered over ``group`` and trimmed to the vocab. ``dtype`` is the activation dtype
    the matmul runs in (NxD's ``dtype``; bf16 as in the port); the hidden state is cast to it. With
    ``tp == 1`` it is the unsharded head and no process group is needed.
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, shard: VocabShard, group=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.shape[0] != shard.rows_per_rank:
            raise ValueError(
                f"qweight must be int8 [rows_per_rank={shard.rows_per_rank}, hidden]; "
                f"got {qweight.dtype} {tuple(qweight.shape)}"
            )
        if tuple(scale.shape) != (shard.rows_per_rank, 1):
            raise ValueError(f"scale must be [{shard.rows_per_rank}, 1]; got {tuple(scale.shape)}")
        if shard.tp > 1:
            _check_group(shard, group)
        if not dtype.is_floating_point:
            raise ValueError(f"dtype {dtype} must be a floating-point activation dtype (torch.bfloat16 as in the port)")
        self.shard = shard
        self.group = group
        self.dtype = dtype
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float())

    @classmethod
    def from_rows(cls, rows_fn: Callable[[int, int], torch.Tensor], vocab_size: int, hidden_size: int,
                  tp: int, rank: int, group=None, align_rows: int = DEFAULT_ALIGN_ROWS,
                  chunk_rows: int = DEFAULT_CHUNK_ROWS, dtype: torch.dtype = torch.bfloat16) -> VocabParallelLMHead:
        """Build rank ``rank``'s shard, reading only its own rows through ``rows_fn(a, b)``."""
        shard = vocab_shard(vocab_size, tp, rank, align_rows)
        q, scale = quantize_rows(rows_fn, shard.start, shard.stop, hidden_size,
                                 out_rows=shard.rows_per_rank, chunk_rows=chunk_rows)
        return cls(q, scale, shard, group, dtype=dtype)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, tp: int, rank: int, group=None,
                    align_rows: int = DEFAULT_ALIGN_ROWS, dtype: torch.dtype = torch.bfloat16) -> VocabParallelLMHead:
        """Build a shard from a full float weight ``[vocab, hidden]`` (e.g. ``embed_tokens.weight``)."""
        if weight.dim() != 2:
            raise ValueError(f"weight must be [vocab, hidden]; got shape {tuple(weight.shape)}")
        weight = weight.detach()
        return cls.from_rows(lambda a, b: weight[a:b], weight.shape[0], weight.shape[1], tp, rank,
                             group=group, align_rows=align_rows, dtype=dtype)

    @property
    def vocab_size(self) -> int:
        return self.shard.vocab_size

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors this rank holds: int8 rows (padding included) + fp32 scales."""
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * self.scale.element_size()

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's logits ``[..., rows_per_rank]`` (``gather_output=False``); padding columns ``-inf``."""
        n = self.shard.real_rows
        logits = int8_matmul(hidden.to(self.dtype), self.qweight[:n], self.scale[:n])
        if self.shard.pad_rows:
            pad = logits.new_full((*logits.shape[:-1], self.shard.pad_rows), float("-inf"))
            logits = torch.cat([logits, pad], dim=-1)
        return logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.local_logits(hidden).contiguous()
        if self.shard.tp == 1:
            return local[..., : self.vocab_size]
        parts = [torch.empty_like(local) for _ in range(self.shard.tp)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]

    def extra_repr(self) -> str:
        s = self.shard
        return (f"rank={s.rank}/{s.tp}, rows=[{s.start}, {s.stop}) + {s.pad_rows} padding, "
                f"hidden={self.qweight.shape[1]}, int8 per-row, {self.dtype}, gather_output=True")


def _check_group(shard: VocabShard, group) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"a VocabParallelLMHead with tp={shard.tp} needs torch.distributed initialised with world size "
            f"{shard.tp}: build it inside a worker started by gemma_nb.ranks.run_tp (or use tp=1)"
        )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world != shard.tp or rank != shard.rank:
        raise ValueError(
            f"shard for rank {shard.rank} of tp={shard.tp}, but this process is rank {rank} of a group of "
            f"{world}: build each rank's shard with tp = world size and its own rank"
        )


def softcap_logits(logits: torch.Tensor, cap: float | None = SOFTCAP) -> torch.Tensor:
    """Gemma's final logit softcapping ``cap * tanh(logits / cap)`` (None: unchanged).

    Applied on the host after the gather, as the port did; the same three operations, in the same
    order and dtype, as transformers' ``Gemma4ForCausalLM`` (so its logits can be compared exactly).
    """
    if cap is None:
        return logits
    if not cap > 0:
        raise ValueError(f"softcap {cap!r} must be positive (Gemma-4 uses 30.0) or None")
    return torch.tanh(logits / cap) * cap


def bf16_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The replicated bf16 head the port started from: ``hidden.bf16 @ weight.bf16.T``, bf16 logits."""
    return torch.nn.functional.linear(hidden.to(torch.bfloat16), weight.to(torch.bfloat16))


# --- jobs the notebook and tests start with run_tp (importable, so spawn can find them) -------


def _rss_bytes() -> int:
    """This process's resident set, after handing freed heap back to the OS (glibc), so temporaries
    freed a moment ago do not count as growth."""
    import ctypes
    import ctypes.util

    import psutil

    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)
    return psutil.Process().memory_info().rss


def lm_head_job(rank: int, world_size: int, weight: torch.Tensor, hidden: torch.Tensor,
                align_rows: int = DEFAULT_ALIGN_ROWS, dtype: torch.dtype = torch.bfloat16) -> dict:
    """One rank: quantize its rows of ``weight [V, H]``, return its shard facts and the gathered logits."""
    head = VocabParallelLMHead.from_weight(weight, tp=world_size, rank=rank, align_rows=align_rows, dtype=dtype)
    with torch.inference_mode():
        logits = head(hidden)
    s = head.shard
    return {"rank": rank, "start": s.start, "stop": s.stop, "pad_rows": s.pad_rows,
            "shard_bytes": head.nbytes, "logits": logits}


def _median_ms(fn: Callable[[], Any], repeats: int, sync: bool) -> float:
    times = []
    for _ in range(repeats):
        if sync:
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def full_size_job(rank: int, world_size: int, seed: int, vocab_size: int, hidden_size: int,
                  hidden: torch.Tensor, repeats: int = 5, std: float = 0.02) -> dict:
    """One rank at the real size, before and after the fix, measured from the tensors it holds.

    Before: the replicated bf16 head (the whole seeded table, as every rank held it), its bytes,
    RSS growth and bf16 matmul time per token; then freed. After: this rank's int8 shard, built
    from its own rows of the seeded table only (:func:`seeded_rows`), its bytes and RSS growth,
    the gathered logits of ``hidden [T, H]`` and the gathered head's time per token (1 token,
    ranks started together by a barrier; median of ``repeats``).
    """
    import gc

    with torch.inference_mode():
        rss0 = _rss_bytes()
        replicated = seeded_table(seed, vocab_size, hidden_size, std=std)
        rss1 = _rss_bytes()
        replicated_bytes = replicated.numel() * replicated.element_size()
        token = hidden[:1]
        bf16_ms = _median_ms(functools.partial(bf16_head_logits, token, replicated), max(1, repeats // 2), sync=True)
        del replicated
        gc.collect()

        rss2 = _rss_bytes()
        head = VocabParallelLMHead.from_rows(
            lambda a, b: seeded_rows(seed, a, b, hidden_size, std=std), vocab_size, hidden_size,
            tp=world_size, rank=rank,
        )
        rss3 = _rss_bytes()
        logits = head(hidden)
        gathered_ms = _median_ms(lambda: head(token), repeats, sync=True)
    s = head.shard
    return {
        "rank": rank, "start": s.start, "stop": s.stop,
        "replicated_bf16_bytes": replicated_bytes, "replicated_bf16_rss_growth": rss1 - rss0,
        "shard_weight_bytes": head.qweight.numel() * head.qweight.element_size(),
        "shard_scale_bytes": head.scale.numel() * head.scale.element_size(),
        "shard_bytes": head.nbytes, "shard_rss_growth": rss3 - rss2,
        "replicated_bf16_ms_per_token": bf16_ms, "gathered_int8_ms_per_token": gathered_ms,
        "logits": logits,
    }


# --- what the notebook reports ---------------------------------------------------------------


def logits_agreement(reference: torch.Tensor, candidate: torch.Tensor) -> dict:
    """Bit-exactness, argmax identity, top-1 agreement and max |difference| of two logit tensors [..., V]."""
    if reference.shape != candidate.shape:
        raise ValueError(f"logits shapes differ: reference {tuple(reference.shape)}, candidate {tuple(candidate.shape)}")
    ref_top, cand_top = reference.argmax(-1), candidate.argmax(-1)
    return {
        "bit_exact": bool(torch.equal(reference, candidate)),
        "argmax_identical": bool(torch.equal(ref_top, cand_top)),
        "top1_agreement": float((ref_top == cand_top).float().mean()),
        "max_abs_diff": float((reference.float() - candidate.float()).abs().max()),
        "positions": int(ref_top.numel()),
    }


@torch.no_grad()
def head_inputs(model, input_ids_batches: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What a transformers Gemma-4 feeds its lm_head, and what it outputs, at every position.

    Returns ``hidden [N, H]`` (the final-norm output, ``model.model(...).last_hidden_state``) and
    the model's own ``logits [N, V]`` (softcapped), N = all positions of all batches.
    """
    hidden, logits = [], []
    for ids in input_ids_batches:
        hidden.append(model.model(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size))
        logits.append(model(input_ids=ids, use_cache=False).logits.reshape(-1, model.config.vocab_size))
    return torch.cat(hidden), torch.cat(logits)


def bytes_table(results: Sequence[dict], host_embedding: torch.Tensor) -> pd.DataFrame:
    """Where each copy of the tied table lives and its bytes, before and after, from measured tensors.

    ``results``: the :func:`full_size_job` dicts, one per rank. ``host_embedding``: the table the
    host keeps for the lookup. Rows: (state, holder, copy, dtype, bytes, gb).
    """
    host_bytes = host_embedding.numel() * host_embedding.element_size()
    host_dtype = str(host_embedding.dtype).replace("torch.", "")
    rows = []
    for state in ("before", "after"):
        rows.append({"state": state, "holder": "host", "copy": "embedding table (lookup)",
                     "dtype": host_dtype, "bytes": host_bytes})
        for r in results:
            if state == "before":
                rows.append({"state": state, "holder": f"rank {r['rank']}", "copy": "lm_head, replicated",
                             "dtype": "bfloat16", "bytes": r["replicated_bf16_bytes"]})
            else:
                rows.append({"state": state, "holder": f"rank {r['rank']}",
                             "copy": f"lm_head rows [{r['start']}, {r['stop']})",
                             "dtype": "int8 + fp32 scale", "bytes": r["shard_bytes"]})
    table = pd.DataFrame(rows)
    table["gb"] = table["bytes"] / 1e9
    return table


def plot_bytes_per_holder(table, claims=None):
    """Stacked bars, before and after: embedding table on the host, lm_head on each rank (GB).

    Lines at the story's per-rank figures (replicated bf16 head, int8 sharded head), named in the
    legend. Returns the figure, for ``gemma_nb.plots.show_figure``.
    """
    claims = CLAIMS if claims is None else claims
    fig, ax = plots.subplots(figsize=(7.5, 4.6))
    holders = list(dict.fromkeys(table["holder"]))
    labels, embed_gb, head_gb = [], [], []
    for state in ("before", "after"):
        for holder in holders:
            part = table[(table["state"] == state) & (table["holder"] == holder)]
            labels.append(f"{holder}\n{state}")
            embed_gb.append(float(part.loc[part["copy"].str.startswith("embedding"), "gb"].sum()))
            head_gb.append(float(part.loc[part["copy"].str.startswith("lm_head"), "gb"].sum()))
    # A gap between the before and after groups.
    x = [i + (0.6 if i >= len(holders) else 0.0) for i in range(len(labels))]
    _ = ax.bar(x, embed_gb, label="embedding table (host, bf16)")
    _ = ax.bar(x, head_gb, bottom=embed_gb, label="lm_head (on each rank)")
    _ = ax.set_xticks(x, labels)
    _ = ax.set_ylim(0, 1.15 * max(e + h for e, h in zip(embed_gb, head_gb)))
    _ = ax.set_ylabel("bytes held (GB)")
    _ = ax.set_title("Tied table: replicated bf16 head vs int8 head sharded over 2 ranks")
    for (key, what), style in zip((("lm_head_bf16_gb_per_rank", "bf16 head"),
                                   ("lm_head_int8_sharded_gb_per_rank", "int8 sharded head")), ("--", ":")):
        value = claims[key].value
        _ = ax.axhline(value, color="0.25", linestyle=style, linewidth=1.2, label=f"story: {what} {value:g} GB/rank")
    _ = ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False, fontsize=9)
    return fig


def shard_plan(vocab_size: int, tp: int, align_rows: int = DEFAULT_ALIGN_ROWS) -> pd.DataFrame:
    """Which rows each rank holds (one row per rank): start, stop, real rows, padding rows."""
    shards = [vocab_shard(vocab_size, tp, r, align_rows) for r in range(tp)]
    return pd.DataFrame([{"rank": s.rank, "start": s.start, "stop": s.stop, "real_rows": s.real_rows,
                          "pad_rows": s.pad_rows, "rows_per_rank": s.rows_per_rank} for s in shards])


def with_head(model, head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``input_ids [B, S] -> logits [B, S, V]``: ``model``'s body, then ``head``, then the host softcap.

    For scoring a replacement head with ``gemma_nb.evaluate`` (e.g. ``fact_recall``).
    """
    cap = getattr(model.config, "final_logit_softcapping", None)

    @torch.no_grad()
    def logits_fn(input_ids: torch.Tensor) -> torch.Tensor:
        hidden = model.model(input_ids=input_ids).last_hidden_state
        return softcap_logits(head(hidden).float(), cap)

    return logits_fn
