"""Weight-only quantization formats, measured: int8, fp8 e4m3, MXFP4 and NVFP4 (notebook 02).

Every format quantizes along the *output rows* of a weight ``[out, in]`` (or ``[E, out, in]`` for
stacked experts): int8 and fp8 keep one fp32 scale per output row (``scale [out, 1]``, the
``quantization_per_channel_axis=0`` layout NxD's ``QuantizedColumnParallel`` needs); the fp4 formats
keep one scale per block of 32 (MXFP4) or 16 (NVFP4) consecutive input elements of a row.

The int8 forward (``int8_matmul``) mirrors NxD's int8 layers, which upcast the int8 weight to the
activation dtype, run the matmul, then ``scale_dequantize`` the *output* in fp32::

    y = ((x @ q.to(x.dtype).T).float() * scale.T).to(x.dtype)

Each output column depends only on its own row of ``q`` and ``scale``, so a vocab-parallel head that
splits ``q``/``scale`` by rows and concatenates the partial outputs gives the same numbers as the
whole head (tested in ``tests/test_quant.py``).
"""

from __future__ import annotations

import torch
from torch import nn

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
        q, scale = quantize_int8_per_channel(weight.detach(), axis=0, name=name)
        return cls(q, scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear, name: str = "linear") -> "Int8Linear":
        if getattr(linear, "bias", None) is not None:
            raise ValueError(f"{name!r} has a bias; Int8Linear covers the bias-free linears Gemma-4 uses")
        return cls.from_weight(linear.weight, name=f"{name}.weight")

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, self.qweight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"
