"""Weight formats: what each stores, its bytes, and the quantizer that writes it (notebooks 01, 02).
Quantized formats work along the output rows of ``[out, in]`` (or ``[E, out, in]``, per expert)."""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gemma_nb.targets import one_thread

INT8_QMAX = 127
# The port's quantizer floors the scale so an all-zero row gives scale 1e-8 and q = 0, never NaN.
INT8_MIN_SCALE = 1e-8


def quantize_int8_per_channel(
    weight: torch.Tensor, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(weight, "int8")``: the port's int8 for its experts, shared MLP and lm_head,
    ``scale = max(absmax(row) / 127, 1e-8)``, ``q = clamp(round(w / scale), -127, 127)``, per
    output row (of ``[out, in]``, or of each expert's ``[E, out, in]``)."""
    quantized = quantize(weight, "int8", name)
    return quantized.data, quantized.scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (q.float() * scale).float()


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., in] @ dequant(q [out, in], scale [out, 1]).T`` in ``x.dtype``, NxD's order (rows
    scaled in fp32)."""
    assert q.dtype == torch.int8 and q.dim() == 2, (
        f"q is {q.dtype} {tuple(q.shape)}; expected int8 [out, in]"
    )
    assert scale.shape == (q.shape[0], 1), (
        f"scale must have shape [out, 1], got {tuple(scale.shape)}"
    )
    return scale_rows(F.linear(x, q.to(x.dtype)), scale.reshape(-1), x.dtype)


def scale_rows(out: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An int8 matmul's output times its per-row ``scale``, in fp32, cast to ``dtype`` (NxD's
    order)."""
    return (out.float() * scale.float()).to(dtype)


class WeightFormat(NamedTuple):
    """How a format stores ``[out, in]``: element bits, block along ``in`` (fp4), scale dtype; NVFP4
    adds a per-matrix scale."""

    name: str
    element_bits: int
    description: str
    block_size: int | None = None
    scale_dtype: torch.dtype | None = None
    per_tensor_scale: bool = False

    quantized = property(lambda f: f.scale_dtype is not None)


FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("fp32", 32, "IEEE float32"),
        WeightFormat("bf16", 16, "bfloat16"),
        WeightFormat("fp16", 16, "IEEE float16"),
        WeightFormat(
            "fp8",
            8,
            "float8_e4m3fn, fp32 scale per output row (absmax/448)",
            scale_dtype=torch.float32,
        ),
        WeightFormat(
            "int8",
            8,
            "symmetric int8, fp32 scale per output row (absmax/127), the port's format",
            scale_dtype=torch.float32,
        ),
        WeightFormat(
            "mxfp4",
            4,
            "E2M1, block 32, power-of-two E8M0 scale (uint8 biased exponent), OCP MX",
            block_size=32,
            scale_dtype=torch.uint8,
        ),
        WeightFormat(
            "nvfp4",
            4,
            "E2M1, block 16, e4m3 block scale x fp32 per-tensor scale",
            block_size=16,
            scale_dtype=torch.float8_e4m3fn,
            per_tensor_scale=True,
        ),
    )
}
PLAIN_DTYPES = tuple(name for name, f in FORMATS.items() if not f.quantized)
QUANTIZED_FORMATS: dict[str, WeightFormat] = {
    name: FORMATS[name] for name in ("int8", "fp8", "mxfp4", "nvfp4")
}


def get_format(dtype: str, quantized: bool = False) -> WeightFormat:
    """The format named ``dtype`` (``quantized``: one of ``QUANTIZED_FORMATS``); else ValueError
    naming the known ones."""
    known, what = (QUANTIZED_FORMATS, "weight format") if quantized else (FORMATS, "dtype")
    if dtype not in known:
        raise ValueError(f"{what} {dtype!r} is not one of {', '.join(known)}")
    return known[dtype]


def tensor_bytes(shape: Sequence[int] | int, dtype: str) -> int:
    """Stored bytes of one tensor (``[E, out, in]``: E matrices) in ``dtype``, scales included."""
    fmt = get_format(dtype)
    dims = (int(shape),) if isinstance(shape, int) else tuple(int(d) for d in shape)
    assert all(d >= 0 for d in dims), f"shape {dims} has a negative dimension"
    if not fmt.quantized:
        return math.prod(dims) * fmt.element_bits // 8
    assert len(dims) >= 2, f"{dtype} stores matrices [out, in], got shape {dims}"
    *stack, out, inp = dims
    block = fmt.block_size or inp  # a scale per block (fp4) or per output row (int8, fp8)
    blocks = -(-inp // block) if fmt.block_size else 1
    row_bytes = blocks * (block * fmt.element_bits // 8 + fmt.scale_dtype.itemsize)
    # NVFP4: an fp32 scale per matrix
    return math.prod(stack) * (out * row_bytes + (4 if fmt.per_tensor_scale else 0))


FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
FP4_E2M1_MAX = 6.0
# The 16 E2M1 codes (sign bit 3, two exponent bits, one mantissa bit), OCP MX order: 0..7 positive.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_E2M1_VALUES = _E2M1_MAGNITUDES + tuple(-value for value in _E2M1_MAGNITUDES)
E8M0_BIAS = 127
# Rows are quantized in fp32 chunks of ~1M elements (4 MB): a 26B expert tensor never needs an fp32
# copy.
CHUNK_ELEMENTS = 1 << 20


@dataclass
class QuantizedTensor:
    """One quantized weight. fp4 ``data``: two E2M1 codes per byte (element ``2j`` low), rows
    zero-padded to whole blocks."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, ...]
    global_scale: torch.Tensor | None = None
    name: str = "weight"

    format = property(lambda self: get_format(self.fmt, quantized=True))
    nbytes = property(
        lambda self: sum(
            t.numel() * t.element_size()
            for t in (self.data, self.scale, self.global_scale)
            if t is not None
        )
    )

    def __getitem__(self, index: int) -> "QuantizedTensor":
        """Expert ``index`` of a stacked ``[E, out, in]`` weight, as its own ``[out, in]``
        tensor."""
        assert len(self.shape) >= 3, (
            f"{self.name!r} has shape {self.shape}; only [E, out, in] can be indexed"
        )
        return QuantizedTensor(
            self.fmt,
            self.data[index],
            self.scale[index],
            tuple(self.shape[1:]),
            None if self.global_scale is None else self.global_scale[index],
            f"{self.name}[{index}]",
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight of ``shape``, computed in fp32 and returned as ``dtype``."""
        if self.fmt in ("int8", "fp8"):
            return (self.data.float() * self.scale).to(dtype)
        blocks = unpack_fp4(self.data).unflatten(-1, (-1, self.format.block_size))
        scale = (
            e8m0_to_float(self.scale)
            if self.fmt == "mxfp4"
            else self.scale.float() * self.global_scale
        )
        weight = (blocks * scale.unsqueeze(-1)).flatten(-2)
        return weight[..., : self.shape[-1]].to(dtype)


def e8m0_to_float(exponent: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> fp32 powers of two, ``2 ** (e - 127)`` (255, E8M0's NaN, is never
    written)."""
    return torch.exp2(exponent.to(torch.float32) - E8M0_BIAS)


# E2M1 rounding: the magnitude code (0..7) counts the midpoints |x| passes; ties go to the even code
# (``>=`` where the upper neighbour is even, else ``>``). ~5x faster on cpu than
# ``torch.bucketize``.
_E2M1_MIDPOINTS = tuple(
    ((low + high) / 2, code % 2 == 1)
    for code, (low, high) in enumerate(zip(_E2M1_MAGNITUDES, _E2M1_MAGNITUDES[1:]))
)
_E2M1_LUT = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
# byte -> (value of the low nibble, value of the high nibble)
_E2M1_BYTE_LUT = torch.stack(
    (_E2M1_LUT[torch.arange(256) & 0x0F], _E2M1_LUT[torch.arange(256) >> 4]), dim=-1
)


def e2m1_codes(magnitude: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """fp32 magnitudes and their ``negative`` signs -> nearest OCP E2M1 codes: ties to even,
    saturating, never -0."""
    code = torch.zeros(magnitude.shape, dtype=torch.uint8, device=magnitude.device)
    for midpoint, tie_goes_up in _E2M1_MIDPOINTS:
        code += torch.ge(magnitude, midpoint) if tie_goes_up else torch.gt(magnitude, midpoint)
    # the sign bit only where the magnitude code is not 0 (-0.2 rounds to +0)
    code |= (negative & code.bool()).to(torch.uint8) << 3
    return code


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 ``[..., n]`` (n even) -> bytes ``[..., n / 2]``, element 2j in the low
    nibble."""
    assert codes.shape[-1] % 2 == 0, f"cannot pack an odd number ({codes.shape[-1]}) of fp4 codes"
    assert codes.dtype == torch.uint8, f"fp4 codes must be uint8, got {codes.dtype}"
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """bytes ``[..., m]`` -> fp32 E2M1 values ``[..., 2m]`` (one lookup per byte: both nibbles'
    values)."""
    pairs = _E2M1_BYTE_LUT.to(packed.device).index_select(0, packed.flatten().int())
    return pairs.view(*packed.shape[:-1], 2 * packed.shape[-1])


def _quantize_rows(
    rows: torch.Tensor,
    fmt: WeightFormat,
    global_scale: torch.Tensor | None,
    name: str,
    first_row: int,
):
    """fp32 ``[R, in]`` (a private copy, padded for fp4; modified in place) -> (data, scale)."""
    if fmt.block_size is None:
        absmax = rows.abs().amax(dim=-1).unsqueeze(-1)
        _check_absmax(absmax, rows, name, first_row)
        if fmt.name == "int8":
            scale = (absmax / INT8_QMAX).clamp_min(INT8_MIN_SCALE)
            # w / scale as the port did; |w / scale| <= 127 by construction, the clamp guards
            # rounding
            return rows.div_(scale).round_().clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8), scale
        # fp8: floor at the smallest normal fp32 so an all-zero row gives 0 / tiny = 0, never 0 / 0;
        # clamp before the cast, since an out-of-range value casts to NaN in float8_e4m3fn
        scale = (absmax / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        return rows.div_(scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale
    blocks = rows.unflatten(-1, (rows.shape[-1] // fmt.block_size, fmt.block_size))
    magnitude = block_absmax = blocks.abs()
    while block_absmax.shape[-1] > 1:  # max over the block by halving: ~4x faster on cpu than amax
        half = block_absmax.shape[-1] // 2
        block_absmax = torch.maximum(block_absmax[..., :half], block_absmax[..., half:])
    block_absmax = block_absmax[..., 0]
    _check_absmax(block_absmax, rows, name, first_row)
    if fmt.name == "mxfp4":
        # OCP MX: shared exponent = floor(log2(absmax)) - 2 (absmax in (6, 8) x 2^e saturates to +-6
        # x 2^e); floor(log2) read exactly off frexp's exponent (torch.log2 rounds up just below a
        # power of two).
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
    codes = e2m1_codes(magnitude.mul_(inverse.unsqueeze(-1)), torch.lt(blocks, 0)).flatten(-2)
    return pack_fp4(codes), scale_code


def quantize(weight: torch.Tensor, fmt: str, name: str = "weight") -> QuantizedTensor:
    """Quantize ``weight [..., out, in]`` to ``fmt`` per output row / block, in fp32 chunks on one
    thread. NaN/inf raise ValueError naming ``name``; all-zero rows dequantize to zero."""
    spec = get_format(fmt, quantized=True)
    assert torch.is_floating_point(weight) and weight.dim() >= 2, (
        f"{name!r} is {weight.dtype} {tuple(weight.shape)}"
    )
    shape, cols = tuple(weight.shape), weight.shape[-1]
    padded = cols if spec.block_size is None else -(-cols // spec.block_size) * spec.block_size
    with torch.no_grad(), one_thread():
        rows_view = weight.detach().reshape(-1, cols)
        rows_per_matrix, chunk_rows = shape[-2], max(1, CHUNK_ELEMENTS // max(cols, 1))
        starts = range(0, rows_view.shape[0], chunk_rows)
        global_scale = row_global = None
        if spec.per_tensor_scale:
            row_absmax = torch.cat(
                [rows_view[i : i + chunk_rows].float().abs().amax(dim=-1) for i in starts]
            )
            _check_absmax(row_absmax, rows_view, name, 0)
            matrix_absmax = row_absmax.view(-1, rows_per_matrix).amax(dim=-1)
            # NVFP4: the largest element maps to 6 x 448, the top of E2M1 x e4m3
            global_scale = torch.where(
                matrix_absmax > 0, matrix_absmax / (FP4_E2M1_MAX * FP8_E4M3_MAX), 1.0
            )
            row_global = global_scale.repeat_interleave(rows_per_matrix).unsqueeze(-1)  # [rows, 1]
        pieces = []
        for start in starts:
            rows = rows_view[start : start + chunk_rows]
            # a fresh fp32 copy (never a view of the caller's weight), zero-padded to whole blocks
            chunk = (
                rows.to(torch.float32, copy=True)
                if padded == cols
                else F.pad(rows.float(), (0, padded - cols))
            )
            chunk_global = None if row_global is None else row_global[start : start + chunk_rows]
            pieces.append(_quantize_rows(chunk, spec, chunk_global, name, start))
        data, scale = (torch.cat(part).reshape(*shape[:-1], -1) for part in zip(*pieces))
        global_scale = None if global_scale is None else global_scale.reshape(*shape[:-2], 1, 1)
    return QuantizedTensor(fmt, data, scale, shape, global_scale, name)


def _check_absmax(absmax: torch.Tensor, rows: torch.Tensor, name: str, first_row: int) -> None:
    """A non-finite absmax means a NaN/inf weight: raise ValueError naming the tensor and where."""
    if bool(torch.isfinite(absmax).all()):
        return
    row, col = (~torch.isfinite(rows)).nonzero()[0].tolist()
    raise ValueError(
        f"tensor {name!r} holds non-finite values (first: {rows[row, col].item()} in flattened row "
        f"{first_row + row}, column {col}); fix the checkpoint before quantizing it"
    )


@torch.no_grad()
def quantization_error(weight: torch.Tensor, quantized: QuantizedTensor) -> dict[str, float]:
    """Relative Frobenius error ``|W - Q(W)| / |W|`` and max absolute error, in fp32, chunked by
    matrix."""
    diff_sq = ref_sq = max_abs = 0.0
    matrices = weight.reshape(-1, *weight.shape[-2:])
    for i in range(matrices.shape[0]):
        ref = matrices[i].float()
        diff = ref - (quantized[i] if weight.dim() > 2 else quantized).dequantize(torch.float32)
        diff_sq += float(diff.square().sum())
        ref_sq += float(ref.square().sum())
        max_abs = max(max_abs, float(diff.abs().max()))
    return {
        "rel_error": math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else 0.0,
        "max_abs_error": max_abs,
    }


def register_quantized(module: nn.Module, prefix: str, quantized: QuantizedTensor) -> None:
    """Store a QuantizedTensor's tensors as buffers of ``module`` (format and shape in
    ``module._quantized_meta``)."""
    for part in ("data", "scale", "global_scale"):
        module.register_buffer(f"{prefix}_{part}", getattr(quantized, part))
    module._quantized_meta[prefix] = (quantized.fmt, quantized.shape, quantized.name)


def registered_quantized(module: nn.Module, prefix: str) -> QuantizedTensor:
    fmt, shape, name = module._quantized_meta[prefix]
    data, scale, global_scale = (
        getattr(module, f"{prefix}_{part}") for part in ("data", "scale", "global_scale")
    )
    return QuantizedTensor(fmt, data, scale, shape, global_scale, name)
