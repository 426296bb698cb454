"""Weight-only quantization formats, measured: int8, fp8 e4m3, MXFP4 and NVFP4 (notebook 02).

Every format quantizes along the *output rows* of a weight ``[out, in]`` (or ``[E, out, in]`` for
stacked experts, each expert on its own): int8 and fp8 keep one fp32 scale per output row
(``scale [out, 1]``, the ``quantization_per_channel_axis=0`` layout NxD's ``QuantizedColumnParallel``
needs); the fp4 formats keep one scale per block of 32 (MXFP4, E8M0 power-of-two scale) or 16
(NVFP4, e4m3 scale times one fp32 scale per matrix) consecutive inputs of a row, and store two E2M1
codes per byte, so ``QuantizedTensor.nbytes`` is what is really stored. fp4 rows whose length is not
a multiple of the block are zero-padded (stored, counted, cut off again by ``dequantize``).
``gemma_nb.memory.tensor_bytes`` is the byte formula; the tests check the two agree.

- ``quantize_int8_per_channel`` / ``dequantize_int8`` / ``int8_matmul`` / ``Int8Linear``: the port's
  int8 path. The int8 forward mirrors NxD's int8 layers, which upcast the int8 weight to the
  activation dtype, run the matmul, then ``scale_dequantize`` the *output* in fp32::

      y = ((x @ q.to(x.dtype).T).float() * scale.T).to(x.dtype)

  Each output column depends only on its own row of ``q`` and ``scale``, so a vocab-parallel head that
  splits ``q``/``scale`` by rows and concatenates the partial outputs gives the same numbers as the
  whole head (tested).
- ``quantize(weight, fmt)`` -> ``QuantizedTensor`` for any of ``FORMATS``; ``QuantizedLinear`` and
  ``QuantizedExperts`` (a drop-in for transformers' ``Gemma4TextExperts``) dequantize to the
  activation dtype in their forward.
- ``apply_scheme(model, scheme)``: quantize a loaded Gemma-4 model's groups (experts, shared MLP,
  attention, lm_head) in place; scheme names are the memory planner's.
- ``full_size_experts_check``: one full-size layer quantized for real (notebook 02); scoring a scheme on
  a checkpoint (``evaluate_scheme``, ``lm_head_isolation``, ...) is ``gemma_nb.quant_eval``.

Quantization runs in 4 MB fp32 chunks on one intra-op thread (see ``quantize``): NaN/inf weights
raise ValueError naming the tensor; all-zero rows dequantize to zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from gemma_nb.targets import torch_threads

INT8_QMAX = 127
# The port's quantizer floors the scale so an all-zero row gives scale 1e-8 and q = 0, never NaN.
INT8_MIN_SCALE = 1e-8


def check_finite(weight: torch.Tensor, name: str = "weight") -> None:
    """Raise ValueError naming ``name`` if ``weight`` holds NaN or inf (a broken checkpoint)."""
    if not torch.is_floating_point(weight):
        raise ValueError(f"tensor {name!r} has dtype {weight.dtype}; expected a floating-point weight to quantize")
    finite = torch.isfinite(weight)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        raise ValueError(
            f"tensor {name!r} holds {int((~finite).sum())} non-finite values (first at index {bad}, "
            f"value {weight[tuple(bad)].item()}); fix the checkpoint before quantizing it"
        )


def _channel_absmax(weight: torch.Tensor, axis: int) -> torch.Tensor:
    """absmax over the input axis, keepdim: one value per channel along ``axis``.

    2-D ``[out, in]``: ``axis`` 0 reduces over ``in`` (-> ``[out, 1]``), 1 over ``out`` (-> ``[1, in]``).
    N-D stacked ``[..., out, in]``: ``axis`` must be the ``out`` axis (N-2); leading axes are a batch
    (one scale per expert per row, -> ``[..., out, 1]``).
    """
    if weight.dim() < 2:
        raise ValueError(f"weight of shape {tuple(weight.shape)} is not a matrix; expected [out, in] or [E, out, in]")
    axis = axis % weight.dim()
    if weight.dim() == 2 and axis == 1:
        return weight.abs().amax(dim=0, keepdim=True)
    if axis != weight.dim() - 2:
        raise ValueError(
            f"channel axis {axis} of a {weight.dim()}-D weight {tuple(weight.shape)} is not supported; "
            f"use the output-row axis {weight.dim() - 2} (0 for a 2-D [out, in] weight)"
        )
    return weight.abs().amax(dim=-1, keepdim=True)


def quantize_int8_per_channel(
    weight: torch.Tensor, axis: int = 0, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int8, as the port quantized its experts, shared MLP and lm_head.

    ``weight [out, in]`` -> ``q int8 [out, in]`` and ``scale fp32 [out, 1]`` with
    ``scale = max(absmax(row) / 127, 1e-8)``, ``q = clamp(round(w / scale), -127, 127)``.
    ``axis`` is the channel axis (0 = output rows, the only one NxD's ColumnParallel accepts); for a
    stacked ``[E, out, in]`` tensor pass ``axis=1`` (or -2) and get ``scale [E, out, 1]``.
    The scale keeps the channel axis with size-1 axes elsewhere, so ``q * scale`` broadcasts back.
    """
    check_finite(weight, name)
    absmax = _channel_absmax(weight.float(), axis)
    scale = (absmax / INT8_QMAX).clamp_min(INT8_MIN_SCALE)
    q = torch.round(weight.float() / scale).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` computed in fp32, returned as ``dtype``."""
    return (q.float() * scale).to(dtype)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., in] @ dequant(q [out, in], scale [out, 1]).T`` -> ``[..., out]`` in ``x.dtype``.

    NxD's order: matmul with the int8 weight upcast to ``x.dtype`` (int8 values are exact in bf16),
    then the output times the per-row scale in fp32, cast back to ``x.dtype``. Deterministic, and
    column-separable: rows of ``q`` can be split across ranks and the outputs concatenated.
    """
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"q must be a 2-D int8 tensor [out, in]; got {q.dtype} of shape {tuple(q.shape)}")
    if scale.shape != (q.shape[0], 1):
        raise ValueError(f"scale must have shape [out, 1] = {(q.shape[0], 1)}; got {tuple(scale.shape)}")
    out = torch.nn.functional.linear(x, q.to(x.dtype))
    return (out.float() * scale.reshape(-1).float()).to(x.dtype)


class Int8Linear(nn.Module):
    """Weight-only int8 ``nn.Linear`` (no bias): buffers ``qweight int8 [out, in]``, ``scale fp32 [out, 1]``.

    Forward is :func:`int8_matmul`. Build one from a float linear with :meth:`from_linear` or from a
    raw weight with :meth:`from_weight`. ``nbytes`` counts the stored int8 weight plus the fp32 scales.
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"qweight must be 2-D int8; got {qweight.dtype} {tuple(qweight.shape)}")
        if scale.shape != (qweight.shape[0], 1):
            raise ValueError(f"scale must be [out, 1] = {(qweight.shape[0], 1)}; got {tuple(scale.shape)}")
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float())

    @classmethod
    def from_weight(cls, weight: torch.Tensor, name: str = "weight") -> "Int8Linear":
        """Same numbers as :func:`quantize_int8_per_channel`, computed in bounded-memory chunks."""
        if weight.dim() != 2:
            raise ValueError(f"{name!r} has shape {tuple(weight.shape)}; Int8Linear needs a 2-D weight [out, in]")
        quantized = quantize(weight, "int8", name=name)
        return cls(quantized.data, quantized.scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear, name: str = "linear") -> "Int8Linear":
        if getattr(linear, "bias", None) is not None:
            raise ValueError(f"{name!r} has a bias; Int8Linear covers the bias-free linears Gemma-4 uses")
        return cls.from_weight(linear.weight, name=f"{name}.weight")

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * self.scale.element_size()

    @property
    def quantized(self) -> "QuantizedTensor":
        """The same weight as a :class:`QuantizedTensor` (format ``int8``), sharing storage."""
        return QuantizedTensor("int8", self.qweight, self.scale, tuple(self.qweight.shape), name="int8_linear")

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, self.qweight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


# ---------------------------------------------------------------------------------------------
# The formats
# ---------------------------------------------------------------------------------------------

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
FP4_E2M1_MAX = 6.0
# The 16 E2M1 codes (sign bit 3, two exponent bits, one mantissa bit), OCP MX order: 0..7 positive.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
# Rows are quantized in fp32 chunks of about 1M elements (4 MB, cache-sized): a full 26B expert
# tensor (gate_up_proj, 128 x 1408 x 2816 = 508M elements) never needs an fp32 copy of itself.
CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class QuantFormat:
    """How a format stores a weight ``[out, in]``: element bits, block along ``in``, scale layout.

    Format names are the memory planner's (``gemma_nb.memory.FORMATS``); its ``tensor_bytes`` is
    the byte formula, and tests check that :attr:`QuantizedTensor.nbytes` (bytes actually stored)
    equals it.
    """

    name: str
    element_bits: int
    block_size: int | None  # None: one scale per output row
    scale_dtype: torch.dtype
    per_tensor_scale: bool  # an extra fp32 scale per weight matrix (NVFP4)
    description: str


FORMATS: dict[str, QuantFormat] = {
    "int8": QuantFormat("int8", 8, None, torch.float32, False,
                        "symmetric int8, fp32 scale per output row (absmax/127), the port's format"),
    "fp8": QuantFormat("fp8", 8, None, torch.float32, False,
                       "float8_e4m3fn, fp32 scale per output row (absmax/448)"),
    "mxfp4": QuantFormat("mxfp4", 4, 32, torch.uint8, False,
                         "E2M1, block 32, power-of-two E8M0 scale (uint8 biased exponent), OCP MX"),
    "nvfp4": QuantFormat("nvfp4", 4, 16, torch.float8_e4m3fn, True,
                         "E2M1, block 16, e4m3 block scale x fp32 per-tensor scale"),
}


def weight_format(fmt: str) -> QuantFormat:
    if fmt not in FORMATS:
        raise ValueError(f"weight format {fmt!r} is not one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


@dataclass
class QuantizedTensor:
    """One quantized weight: what is stored, and how to get the float weight back.

    ``data``: int8 / float8_e4m3fn ``[..., out, in]``, or for fp4 uint8 ``[..., out, in_padded / 2]``
    holding two E2M1 codes per byte (element ``2j`` in the low nibble, ``2j+1`` in the high one,
    as NxD's ``split_byte_4bit_tensor`` reads them). ``scale``: fp32 ``[..., out, 1]`` (int8, fp8),
    uint8 E8M0 exponents ``[..., out, in_padded / 32]`` (MXFP4), e4m3 ``[..., out, in_padded / 16]``
    (NVFP4). ``global_scale``: NVFP4's fp32 per-matrix scale ``[..., 1, 1]``. ``shape`` is the
    original shape; fp4 inputs whose ``in`` is not a multiple of the block are zero-padded (the
    padding is stored and counted in ``nbytes``) and ``dequantize`` cuts it off again.
    """

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, ...]
    global_scale: torch.Tensor | None = None
    name: str = "weight"

    @property
    def format(self) -> QuantFormat:
        return weight_format(self.fmt)

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: elements + scales (+ per-tensor scales)."""
        tensors = [self.data, self.scale] + ([self.global_scale] if self.global_scale is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def __getitem__(self, index: int) -> "QuantizedTensor":
        """Expert ``index`` of a stacked ``[E, out, in]`` weight, as its own ``[out, in]`` tensor."""
        if len(self.shape) < 3:
            raise ValueError(f"{self.name!r} has shape {self.shape}; only stacked [E, out, in] weights can be indexed")
        return QuantizedTensor(
            self.fmt, self.data[index], self.scale[index], tuple(self.shape[1:]),
            None if self.global_scale is None else self.global_scale[index], f"{self.name}[{index}]",
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight of ``shape``, computed in fp32 and returned as ``dtype``."""
        if self.fmt in ("int8", "fp8"):
            return (self.data.float() * self.scale).to(dtype)
        values = unpack_fp4(self.data)
        block = self.format.block_size
        blocks = values.unflatten(-1, (values.shape[-1] // block, block))
        if self.fmt == "mxfp4":
            scale = e8m0_to_float(self.scale)
        else:
            scale = self.scale.float() * self.global_scale
        weight = (blocks * scale.unsqueeze(-1)).flatten(-2)
        return weight[..., : self.shape[-1]].to(dtype)


def e8m0_to_float(exponent: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> fp32 powers of two, ``2 ** (e - 127)`` (255, E8M0's NaN, is never written)."""
    return torch.exp2(exponent.to(torch.float32) - E8M0_BIAS)


# E2M1 rounding by counting the midpoints below |x|: the magnitude code (0..7) is the number of
# midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 that |x| passes. Round-half-to-even decides each
# tie: where the upper neighbour has the even code the tie goes up (``>=``), else down (``>``).
# Seven compare-and-add passes are ~5x faster on cpu than ``torch.bucketize``'s binary search.
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values -> uint8 E2M1 codes 0..15 of the nearest E2M1 value (ties to even, saturating at +-6).

    Codes follow the OCP layout: bit 3 sign, bits 2..1 exponent, bit 0 mantissa (0..7 = 0, 0.5, 1,
    1.5, 2, 3, 4, 6). Zero and values that round to zero get code 0 (never -0).
    """
    return _e2m1_codes(x.abs(), torch.lt(x, 0))


def _e2m1_codes(magnitude: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    code = torch.zeros(magnitude.shape, dtype=torch.uint8, device=magnitude.device)
    for midpoint, tie_goes_up in _E2M1_MIDPOINTS:
        code += torch.ge(magnitude, midpoint) if tie_goes_up else torch.gt(magnitude, midpoint)
    # the sign bit only where the magnitude code is not 0 (-0.2 rounds to +0)
    code |= (negative & code.bool()).to(torch.uint8) << 3
    return code


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to the nearest E2M1 value (the float behind :func:`e2m1_codes`)."""
    codes = e2m1_codes(x)
    return _E2M1_LUT.to(codes.device).index_select(0, codes.flatten().int()).view(codes.shape)


_E2M1_LUT = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)


# byte -> (value of the low nibble, value of the high nibble)
_E2M1_BYTE_LUT = torch.stack((_E2M1_LUT[torch.arange(256) & 0x0F], _E2M1_LUT[torch.arange(256) >> 4]), dim=-1)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 ``[..., n]`` (n even) -> bytes ``[..., n / 2]``, element 2j in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number ({codes.shape[-1]}) of fp4 codes into bytes; pad to even")
    if codes.dtype != torch.uint8:
        raise ValueError(f"fp4 codes must be uint8 0..15; got {codes.dtype}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """bytes ``[..., m]`` -> uint8 codes ``[..., 2m]`` (inverse of :func:`pack_fp4`)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """bytes ``[..., m]`` -> fp32 E2M1 values ``[..., 2m]`` (one lookup per byte: both nibbles' values)."""
    pairs = _E2M1_BYTE_LUT.to(packed.device).index_select(0, packed.flatten().int())
    return pairs.view(*packed.shape[:-1], 2 * packed.shape[-1])


def _absmax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the last axis (NaN propagates, so a non-finite row shows up here)."""
    return x.abs().amax(dim=-1)


def _max_last(magnitude: torch.Tensor) -> torch.Tensor:
    """max over a short power-of-two last axis (a block) by halving: ~4x faster on cpu than amax."""
    while magnitude.shape[-1] > 1:
        half = magnitude.shape[-1] // 2
        magnitude = torch.maximum(magnitude[..., :half], magnitude[..., half:])
    return magnitude[..., 0]


def _quantize_rows(rows: torch.Tensor, fmt: QuantFormat, global_scale: torch.Tensor | None, name: str, first_row: int):
    """fp32 ``[R, in]`` (a private copy, padded for fp4; modified in place) -> (data, scale)."""
    if fmt.block_size is None:
        absmax = _absmax(rows).unsqueeze(-1)
        _check_absmax(absmax, rows, name, first_row)
        if fmt.name == "int8":
            scale = (absmax / INT8_QMAX).clamp_min(INT8_MIN_SCALE)
            # w / scale as the port did; |w / scale| <= 127 by construction, the clamp guards rounding
            return rows.div_(scale).round_().clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8), scale
        # fp8: floor at the smallest normal fp32 so an all-zero row gives 0 / tiny = 0, never 0 / 0;
        # clamp before the cast, since an out-of-range value casts to NaN in float8_e4m3fn
        scale = (absmax / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        return rows.div_(scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale
    blocks = rows.unflatten(-1, (rows.shape[-1] // fmt.block_size, fmt.block_size))
    magnitude = blocks.abs()
    block_absmax = _max_last(magnitude)
    _check_absmax(block_absmax, rows, name, first_row)
    if fmt.name == "mxfp4":
        # OCP MX: shared exponent = floor(log2(absmax)) - emax(E2M1) = floor(log2(absmax)) - 2;
        # a block whose absmax lies in (6, 8) x 2^e saturates to +-6 x 2^e, as in the spec.
        # floor(log2(x)) read exactly off the float's exponent (frexp: x = m * 2^e, 0.5 <= m < 1):
        # torch.log2 rounds to the nearest float, so an fp32 a few ulps below 2^k gives k, not k - 1.
        exponent = (torch.frexp(block_absmax).exponent - 1).float() - 2
        exponent = torch.where(block_absmax > 0, exponent, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
        scale_code = (exponent + E8M0_BIAS).to(torch.uint8)
        effective = e8m0_to_float(scale_code)
    else:  # nvfp4: e4m3 block scale relative to the fp32 per-tensor scale
        block_scale = (block_absmax / (FP4_E2M1_MAX * global_scale)).clamp(max=FP8_E4M3_MAX)
        scale_code = block_scale.to(torch.float8_e4m3fn)
        effective = scale_code.float() * global_scale
    # a block whose scale is 0 (all zero, or an NVFP4 block scale below e4m3's range) encodes zeros
    inverse = torch.where(effective > 0, 1.0 / effective, 0.0)
    codes = _e2m1_codes(magnitude.mul_(inverse.unsqueeze(-1)), torch.lt(blocks, 0)).flatten(-2)
    return pack_fp4(codes), scale_code


def quantize(weight: torch.Tensor, fmt: str, name: str = "weight") -> QuantizedTensor:
    """Quantize ``weight [..., out, in]`` to ``fmt`` (one of ``FORMATS``), per output row / block.

    Leading axes (experts) are a batch: scales are per expert per row (per block for fp4). The rows
    are processed in fp32 chunks of ~1M elements, so a full 26B expert tensor (gate_up_proj,
    128 x 1408 x 2816) needs only its outputs plus a few MB. NaN/inf raise ValueError naming
    ``name``; all-zero rows dequantize to zero. fp4 rows whose length is not a multiple of the
    block are zero-padded (see :class:`QuantizedTensor`).
    """
    spec = weight_format(fmt)
    if not torch.is_floating_point(weight) or weight.dim() < 2:
        raise ValueError(
            f"tensor {name!r} is {weight.dtype} of shape {tuple(weight.shape)}; "
            "expected a floating-point weight [out, in] or [E, out, in]"
        )
    shape = tuple(weight.shape)
    with torch.no_grad(), torch_threads(1):
        rows_view = weight.detach().reshape(-1, shape[-1])
        n_rows, rows_per_matrix = rows_view.shape[0], shape[-2]
        chunk_rows = max(1, CHUNK_ELEMENTS // max(shape[-1], 1))

        global_scale = None
        if spec.per_tensor_scale:
            row_absmax = torch.cat([_absmax(rows_view[i:i + chunk_rows].float()) for i in range(0, n_rows, chunk_rows)])
            _check_absmax(row_absmax, rows_view, name, 0)
            matrix_absmax = row_absmax.view(-1, rows_per_matrix).amax(dim=-1)
            # NVFP4: the largest element maps to 6 x 448, the top of E2M1 x e4m3
            global_scale = torch.where(matrix_absmax > 0, matrix_absmax / (FP4_E2M1_MAX * FP8_E4M3_MAX), 1.0)

        data_chunks, scale_chunks = [], []
        for start in range(0, n_rows, chunk_rows):
            chunk = _padded_fp32_copy(rows_view[start:start + chunk_rows], spec.block_size)
            chunk_global = None
            if global_scale is not None:
                matrix = torch.arange(start, start + chunk.shape[0], device=chunk.device) // rows_per_matrix
                chunk_global = global_scale[matrix].unsqueeze(-1)
            data, scale = _quantize_rows(chunk, spec, chunk_global, name, start)
            data_chunks.append(data)
            scale_chunks.append(scale)
        lead = shape[:-1]
        data = torch.cat(data_chunks).reshape(*lead, -1)
        scale = torch.cat(scale_chunks).reshape(*lead, -1)
        if global_scale is not None:
            global_scale = global_scale.reshape(*shape[:-2], 1, 1)
    return QuantizedTensor(fmt, data, scale, shape, global_scale, name)


def _padded_fp32_copy(rows: torch.Tensor, multiple: int | None) -> torch.Tensor:
    """A fresh fp32 copy of ``rows`` (never a view of the caller's weight), zero-padded to ``multiple``."""
    cols = rows.shape[-1]
    padded = cols if multiple is None else -(-cols // multiple) * multiple
    if padded == cols:
        return rows.to(torch.float32, copy=True)
    out = torch.zeros(rows.shape[0], padded, dtype=torch.float32, device=rows.device)
    out[:, :cols] = rows
    return out


def _check_absmax(absmax: torch.Tensor, rows: torch.Tensor, name: str, first_row: int) -> None:
    """A non-finite absmax means a NaN/inf weight: raise ValueError naming the tensor and where."""
    if bool(torch.isfinite(absmax).all()):
        return
    finite = torch.isfinite(rows)
    row, col = (~finite).nonzero()[0].tolist()
    raise ValueError(
        f"tensor {name!r} holds non-finite values (first: {rows[row, col].item()} in flattened row "
        f"{first_row + row}, column {col}); fix the checkpoint before quantizing it"
    )


@torch.no_grad()
def quantization_error(weight: torch.Tensor, quantized: QuantizedTensor) -> dict[str, float]:
    """Relative Frobenius error ``|W - Q(W)| / |W|`` and max absolute error, in fp32, chunked by matrix."""
    diff_sq = ref_sq = 0.0
    max_abs = 0.0
    matrices = weight.reshape(-1, *weight.shape[-2:])
    for i in range(matrices.shape[0]):
        ref = matrices[i].float()
        deq = (quantized[i] if weight.dim() > 2 else quantized).dequantize(torch.float32)
        diff = ref - deq
        diff_sq += float(diff.square().sum())
        ref_sq += float(ref.square().sum())
        max_abs = max(max_abs, float(diff.abs().max()))
    return {"rel_error": math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else 0.0, "max_abs_error": max_abs}


# ---------------------------------------------------------------------------------------------
# Quantized modules
# ---------------------------------------------------------------------------------------------


def _register_quantized(module: nn.Module, prefix: str, quantized: QuantizedTensor) -> None:
    """Store a QuantizedTensor's tensors as buffers (``<prefix>_data``, ...) so ``.to()`` and state_dict see them."""
    module.register_buffer(f"{prefix}_data", quantized.data)
    module.register_buffer(f"{prefix}_scale", quantized.scale)
    module.register_buffer(f"{prefix}_global_scale", quantized.global_scale)
    module._quantized_meta[prefix] = (quantized.fmt, quantized.shape, quantized.name)


def _registered_quantized(module: nn.Module, prefix: str) -> QuantizedTensor:
    fmt, shape, name = module._quantized_meta[prefix]
    return QuantizedTensor(fmt, getattr(module, f"{prefix}_data"), getattr(module, f"{prefix}_scale"), shape,
                           getattr(module, f"{prefix}_global_scale"), name)


class QuantizedLinear(nn.Module):
    """Bias-free linear holding a :class:`QuantizedTensor`; forward dequantizes to ``x.dtype``.

    ``F.linear(x, Q.dequantize(x.dtype))``: how NxD runs its fp8 and blockwise layers (weight
    dequantized before the matmul). For int8 use :class:`Int8Linear`, which scales the output.
    """

    def __init__(self, quantized: QuantizedTensor):
        super().__init__()
        if len(quantized.shape) != 2:
            raise ValueError(f"{quantized.name!r} has shape {quantized.shape}; a linear needs [out, in]")
        self._quantized_meta = {}
        _register_quantized(self, "weight", quantized)
        self.out_features, self.in_features = quantized.shape

    @property
    def quantized(self) -> QuantizedTensor:
        return _registered_quantized(self, "weight")

    @property
    def nbytes(self) -> int:
        return self.quantized.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.quantized.dequantize(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.quantized.fmt}"


def quantized_linear(weight: torch.Tensor, fmt: str, name: str = "weight") -> nn.Module:
    """An :class:`Int8Linear` (``fmt == "int8"``) or a :class:`QuantizedLinear` for ``weight [out, in]``."""
    if fmt == "int8":
        return Int8Linear.from_weight(weight, name=name)
    return QuantizedLinear(quantize(weight, fmt, name=name))


def routed_experts_forward(hidden_states, top_k_index, top_k_weights, num_experts: int, act_fn: Callable,
                           gate_up_weight: Callable[[int], torch.Tensor], down_weight: Callable[[int], torch.Tensor]):
    """transformers' eager ``Gemma4TextExperts.forward`` with the weights of expert ``e`` from callables.

    For every expert some token routed to: ``act_fn(gate) * up`` from ``gate_up_weight(e) [2I, H]``,
    then ``down_weight(e) [H, I]``, times that token's router weight, summed into ``[T, H]``.
    """
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit[:, 0].tolist():
        if expert_idx == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = torch.nn.functional.linear(current_state, gate_up_weight(expert_idx)).chunk(2, dim=-1)
        current = act_fn(gate) * up
        current = torch.nn.functional.linear(current, down_weight(expert_idx))
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
    return final_hidden_states


class QuantizedExperts(nn.Module):
    """Drop-in for transformers' ``Gemma4TextExperts`` with quantized stacked weights.

    Stores ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` as :class:`QuantizedTensor`
    (scales per expert per output row / block) and runs transformers' eager expert loop, dequantizing
    each routed expert's weights to the activation dtype just before its matmuls (as the port's
    Neuron graph upcasts its int8 weights): for every expert hit, ``gelu_tanh(gate) * up``, then
    ``down``, times the router weight, summed into the output. Same arguments as the original:
    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``.
    """

    def __init__(self, gate_up: QuantizedTensor, down: QuantizedTensor, act_fn: Callable):
        super().__init__()
        self._quantized_meta = {}
        _register_quantized(self, "gate_up", gate_up)
        _register_quantized(self, "down", down)
        self.act_fn = act_fn
        self.num_experts, two_i, self.hidden_dim = gate_up.shape
        self.intermediate_dim = two_i // 2
        if down.shape != (self.num_experts, self.hidden_dim, self.intermediate_dim):
            raise ValueError(f"down_proj shape {down.shape} does not match gate_up_proj {gate_up.shape}")

    @classmethod
    def from_experts(cls, experts: nn.Module, fmt: str, name: str = "experts") -> "QuantizedExperts":
        gate_up = quantize(experts.gate_up_proj, fmt, name=f"{name}.gate_up_proj")
        down = quantize(experts.down_proj, fmt, name=f"{name}.down_proj")
        return cls(gate_up, down, experts.act_fn)

    @property
    def gate_up(self) -> QuantizedTensor:
        return _registered_quantized(self, "gate_up")

    @property
    def down(self) -> QuantizedTensor:
        return _registered_quantized(self, "down")

    @property
    def fmt(self) -> str:
        return self.gate_up.fmt

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def forward(self, hidden_states, top_k_index, top_k_weights):
        dtype = hidden_states.dtype
        gate_up, down = self.gate_up, self.down
        return routed_experts_forward(
            hidden_states, top_k_index, top_k_weights, self.num_experts, self.act_fn,
            lambda e: gate_up[e].dequantize(dtype), lambda e: down[e].dequantize(dtype),
        )

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, {self.fmt}")


# ---------------------------------------------------------------------------------------------
# Schemes: which group of a Gemma-4 model gets which format
# ---------------------------------------------------------------------------------------------

GROUPS = ("experts", "shared_mlp", "attention", "lm_head")


def resolve_scheme(scheme) -> dict[str, str]:
    """A scheme -> ``{group: format}`` for the groups to quantize (groups in bf16 are left out).

    ``scheme``: a name from the memory planner (``gemma_nb.memory.SCHEMES``: ``bf16``,
    ``int8_experts``, ``int8_experts_shared_mlp``, ``int8_squeeze``, ``fp8_experts``,
    ``mxfp4_experts``, ``nvfp4_experts``, ...), a ``memory.Scheme``, or a ``{group: format}`` dict.
    The planner's placement (sharding, host embedding) does not apply to a single-device model;
    only its formats do.
    """
    from gemma_nb import memory

    if isinstance(scheme, (str, memory.Scheme)):
        scheme = memory.get_scheme(scheme).dtypes
    resolved = {}
    for group, fmt in scheme.items():
        if group not in GROUPS:
            if fmt in (None, "bf16", "fp32"):
                continue
            raise ValueError(f"group {group!r} cannot be quantized here; quantizable groups: {', '.join(GROUPS)}")
        if fmt in (None, "bf16", "fp32"):
            continue
        weight_format(fmt)
        resolved[group] = fmt
    return resolved


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "Gemma4TextDecoderLayer"]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no Gemma4TextDecoderLayer; apply_scheme needs a Gemma-4 model")
    return layers


def _linear_targets(layers, group: str) -> list[tuple[nn.Module, str, str]]:
    """(parent module, attribute, dotted name) of every nn.Linear in ``group``."""
    sub, attrs = {"shared_mlp": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                  "attention": ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj"))}[group]
    targets = []
    for layer_name, layer in layers:
        parent = getattr(layer, sub)
        for attr in attrs:
            if isinstance(getattr(parent, attr, None), nn.Linear):
                targets.append((parent, attr, f"{layer_name}.{sub}.{attr}"))
    return targets


def _row(group, fmt, params, stored_bytes, errors) -> dict:
    diff_sq = sum(e["rel_error"] ** 2 * e["ref_sq"] for e in errors)
    ref_sq = sum(e["ref_sq"] for e in errors)
    return {
        "group": group, "format": fmt, "params": params, "bf16_bytes": 2 * params, "stored_bytes": stored_bytes,
        "rel_error": math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else 0.0,
        "max_abs_error": max((e["max_abs_error"] for e in errors), default=0.0),
    }


def _error(weight: torch.Tensor, quantized: QuantizedTensor) -> dict[str, float]:
    err = quantization_error(weight, quantized)
    err["ref_sq"] = float(weight.float().square().sum())
    return err


@torch.no_grad()
def apply_scheme(model: nn.Module, scheme: str | Mapping[str, str]):
    """Quantize a loaded transformers Gemma-4 model in place, group by group; return a report.

    Groups: ``experts`` (every ``Gemma4TextExperts`` -> :class:`QuantizedExperts`), ``shared_mlp``
    (``mlp.gate/up/down_proj``), ``attention`` (``self_attn.q/k/v/o_proj``; global layers have no
    ``v_proj`` when ``attention_k_eq_v``), ``lm_head`` (the tie with ``embed_tokens`` is broken: the
    input embedding keeps its float table, ``lm_head`` gets its own quantized copy). Linears become
    :class:`Int8Linear` for int8, else :class:`QuantizedLinear`.

    Returns a DataFrame, one row per quantized group: ``params``, ``bf16_bytes`` (2 per param),
    ``stored_bytes`` (what the quantized tensors occupy), ``rel_error`` (Frobenius, whole group)
    and ``max_abs_error`` of the dequantized weights against the weights they replaced.
    """
    import pandas as pd

    groups = resolve_scheme(scheme)
    layers = _decoder_layers(model)
    rows = []
    for group, fmt in groups.items():
        params = stored = 0
        errors = []
        if group == "experts":
            for layer_name, layer in layers:
                experts = getattr(layer, "experts", None)
                if experts is None or not hasattr(experts, "gate_up_proj"):
                    raise ValueError(f"{layer_name} has no stacked experts (gate_up_proj): "
                                     "the config needs enable_moe_block=True")
                quantized = QuantizedExperts.from_experts(experts, fmt, name=f"{layer_name}.experts")
                errors += [_error(experts.gate_up_proj, quantized.gate_up), _error(experts.down_proj, quantized.down)]
                params += experts.gate_up_proj.numel() + experts.down_proj.numel()
                stored += quantized.nbytes
                layer.experts = quantized
        elif group == "lm_head":
            head = model.get_output_embeddings()
            if not isinstance(head, nn.Linear):
                raise ValueError(f"lm_head is {type(head).__name__}, already replaced; apply lm_head quantization once")
            # a new quantized table; the tied float table stays with embed_tokens
            weight = head.weight.detach()
            replacement = quantized_linear(weight, fmt, "lm_head.weight")
            errors.append(_error(weight, replacement.quantized))
            params += weight.numel()
            stored += replacement.nbytes
            model.lm_head = replacement
            model.config.tie_word_embeddings = False
        else:
            for parent, attr, name in _linear_targets(layers, group):
                linear = getattr(parent, attr)
                if linear.bias is not None:
                    raise ValueError(f"{name} has a bias; the quantized linears cover Gemma-4's bias-free ones")
                replacement = quantized_linear(linear.weight.detach(), fmt, f"{name}.weight")
                errors.append(_error(linear.weight, replacement.quantized))
                params += linear.weight.numel()
                stored += replacement.nbytes
                setattr(parent, attr, replacement)
        rows.append(_row(group, fmt, params, stored, errors))
    return pd.DataFrame(rows, columns=["group", "format", "params", "bf16_bytes", "stored_bytes",
                                       "rel_error", "max_abs_error"])


# ---------------------------------------------------------------------------------------------
# One full-size layer, quantized for real, against the memory planner's byte formula
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def full_size_experts_check(experts: nn.Module, formats=("int8", "mxfp4", "nvfp4"), tokens: int = 4,
                            top_k: int = 8, seed: int = 0):
    """Quantize one layer's stacked experts to each format; stored bytes vs ``memory.tensor_bytes``.

    ``experts``: a ``Gemma4TextExperts`` (e.g. :func:`random_experts_fast` at the 26B's
    128 x 1408 x 2816 / 128 x 2816 x 704). One format at a time, so peak memory is the float
    weights plus one quantized copy. Returns (table, seconds): one row per (format, tensor) plus a
    ``layer`` row per format with ``stored_bytes``, ``planner_bytes``, ``equal``, the relative
    weight error of expert 0 and, on the layer row, the relative error of the layer output for
    ``tokens`` random tokens routed to ``top_k`` experts; ``seconds`` maps format -> quantize time.
    Runs on one intra-op thread (see :func:`quantize`).
    """
    with torch_threads(1):
        return _full_size_experts_check(experts, formats, tokens, top_k, seed)


def _full_size_experts_check(experts, formats, tokens, top_k, seed):
    import time

    import pandas as pd

    from gemma_nb import memory
    from gemma_nb.moe import random_routing

    generator = torch.Generator().manual_seed(seed)
    dtype = experts.gate_up_proj.dtype
    hidden = torch.randn(tokens, experts.gate_up_proj.shape[-1], generator=generator).to(dtype)
    index, weights = random_routing(tokens, experts.gate_up_proj.shape[0], top_k, seed=seed)
    reference = routed_experts_forward(hidden, index, weights.to(dtype), experts.gate_up_proj.shape[0], experts.act_fn,
                                       lambda e: experts.gate_up_proj[e], lambda e: experts.down_proj[e]).float()
    rows, seconds = [], {}
    for fmt in formats:
        weight_format(fmt)
        start = time.perf_counter()
        quantized = QuantizedExperts.from_experts(experts, fmt, name="experts")
        seconds[fmt] = time.perf_counter() - start
        for tensor_name, tensor in (("gate_up_proj", quantized.gate_up), ("down_proj", quantized.down)):
            weight = getattr(experts, tensor_name)
            rows.append({
                "format": fmt, "tensor": tensor_name, "shape": "x".join(map(str, tensor.shape)),
                "stored_bytes": tensor.nbytes, "planner_bytes": memory.tensor_bytes(tensor.shape, fmt),
                "rel_error_expert0": quantization_error(weight[0], tensor[0])["rel_error"],
            })
        output = quantized(hidden, index, weights.to(dtype)).float()
        rows.append({
            "format": fmt, "tensor": "layer", "shape": "",
            "stored_bytes": quantized.nbytes,
            "planner_bytes": sum(memory.tensor_bytes(t.shape, fmt) for t in (quantized.gate_up, quantized.down)),
            "rel_error_output": float((output - reference).norm() / reference.norm()),
        })
        del quantized
    table = pd.DataFrame(rows)
    table.insert(5, "equal", table["stored_bytes"] == table["planner_bytes"])
    return table, seconds


def random_experts_fast(config, seed: int = 0, std: float = 0.02, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A ``Gemma4TextExperts`` with N(0, std) weights drawn straight into ``dtype``, expert by expert.

    Like ``gemma_nb.moe.random_experts`` (not the same numbers) but ~3x faster on a busy 2-core box:
    ``normal_`` fills the bf16 tensor in place on one intra-op thread (1.5 GB at full size).
    """
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    with torch.device("meta"):
        module = Gemma4TextExperts(config)
    generator = torch.Generator().manual_seed(seed)
    with torch_threads(1):
        for name in ("gate_up_proj", "down_proj"):
            weight = torch.empty(getattr(module, name).shape, dtype=dtype)
            for e in range(weight.shape[0]):
                weight[e].normal_(0.0, std, generator=generator)
            setattr(module, name, nn.Parameter(weight, requires_grad=False))
    return module
