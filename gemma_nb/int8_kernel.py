"""The cpu's int8 weight-only matmul (notebook 07): NxD's numerics (int8 weights, fp32 scale per
output row, bf16 activations) at the speed of memory. One token's GEMV runs a small C kernel built
here on first use where ATen runs AVX2 or AVX-512; other shapes and cpus fall back to torch."""

import ctypes
import functools
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from gemma_nb.formats import int8_matmul


def is_tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


# torch._weight_int8pack_mm's AVX-512 kernel reads K 16 at a time, aligned, no tail (else wrong
# numbers or a crash).
INT8PACK_K_MULTIPLE = 16
INT8PACK_ALIGN_BYTES = 32
# The GEMV keeps one fp32 copy of the activations on its stack.
GEMV_MAX_K = 16384

# Hand-written because no library kernel streams int8 at memory speed on one x86 core: torch's own
# int8 GEMV (ATen's tinygemm) is bound by its arithmetic (4 output rows of 8 lanes, the scale
# multiplied into every weight: ~8 GB/s even from cache), and torchao's int8 weight-only tensor and
# inductor's compiled dequantize-matmul (max-autotune) run slower than bf16 on an AVX2 cpu. This one
# sums 4 rows x 16 columns a step, scales the sum once and prefetches the rows ahead.
GEMV_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define LOAD8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))

static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

static float dot_tail(const float *xf, const int8_t *w, long from, long k) {
    float sum = 0.0f;
    for (long j = from; j < k; j++) sum += xf[j] * w[j];
    return sum;
}

static uint16_t to_bf16(float f) {  /* round to nearest even, as torch casts */
    uint32_t b;
    memcpy(&b, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

/* y[n] = bf16(scale[n] * sum_j x[j] q[n, j]): x bf16 [k], q int8 [n, k] rows contiguous. */
void int8_gemv_bf16(const uint16_t *x, const int8_t *q, const float *scale, uint16_t *y,
                    long n, long k) {
    float xf[k];
    for (long j = 0; j < k; j++) {
        uint32_t b = (uint32_t)x[j] << 16;
        memcpy(&xf[j], &b, 4);
    }
    long body = k - k % 16, full = n - n % 4;
    for (long r0 = 0; r0 < full; r0 += 4) {
        __m256 acc[4][2];
        for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (long j = 0; j < body; j += 16) {
            __m256 x0 = _mm256_loadu_ps(xf + j), x1 = _mm256_loadu_ps(xf + j + 8);
            for (int r = 0; r < 4; r++) {
                const int8_t *w = q + (r0 + r) * k + j;
                _mm_prefetch((const char *)(w + 8 * k), _MM_HINT_T0);
                acc[r][0] = _mm256_fmadd_ps(x0, LOAD8(w), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(x1, LOAD8(w + 8), acc[r][1]);
            }
        }
        for (int r = 0; r < 4; r++) {
            const int8_t *w = q + (r0 + r) * k;
            float sum = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + dot_tail(xf, w, body, k);
            y[r0 + r] = to_bf16(sum * scale[r0 + r]);
        }
    }
    for (long r = full; r < n; r++) y[r] = to_bf16(dot_tail(xf, q + r * k, 0, k) * scale[r]);
}
"""


@functools.cache
def _gemv_library():
    """The GEMV built for this cpu (None where it has no AVX2, or no C compiler is found)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    capability = torch.backends.cpu.get_cpu_capability()
    if compiler is None or capability not in ("AVX2", "AVX512") or platform.machine() != "x86_64":
        return None
    with tempfile.TemporaryDirectory(prefix="gemma_nb_int8_") as folder:
        source, library = Path(folder) / "gemv.c", Path(folder) / "gemv.so"
        source.write_text(GEMV_SOURCE)
        flags = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC"]
        built = subprocess.run(
            [compiler, *flags, "-o", str(library), str(source)], capture_output=True
        )
        if built.returncode != 0:
            return None
        # dlopen maps the file: deleting the folder afterwards keeps the function
        gemv = ctypes.CDLL(str(library)).int8_gemv_bf16
    gemv.restype = None
    gemv.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2
    return gemv


def kernel_name() -> str:
    """The int8 kernel one token's matmul runs on this machine."""
    if _gemv_library() is None:
        return "torch._weight_int8pack_mm"
    return "gemma_nb AVX2 GEMV"


def int8pack_usable(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether ``torch._weight_int8pack_mm(x, q, scales)`` is safe and fast: cpu bf16 ``x [M, K]``,
    contiguous, 32-byte aligned, K % 16 == 0 (fp32 and fp16 take a scalar loop on x86, so they fall
    back too)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and x.dim() == 2
        and x.shape[1] % INT8PACK_K_MULTIPLE == 0
        and x.is_contiguous()
        and q.is_contiguous()
        and x.storage_offset() * x.element_size() % INT8PACK_ALIGN_BYTES == 0
        and (is_tracing() or x.data_ptr() % INT8PACK_ALIGN_BYTES == 0)
    )


def _one_token(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [1, K]`` bf16 against ``q [N, K]``: the GEMV where built, else torch's kernel."""
    gemv = _gemv_library()
    if gemv is None:
        return torch._weight_int8pack_mm(x, q, scale.reshape(-1).to(x.dtype))
    out = torch.empty(1, q.shape[0], dtype=x.dtype)
    scale = scale.reshape(-1).contiguous()
    gemv(x.data_ptr(), q.data_ptr(), scale.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1])
    return out


# The GEMV as a torch op, so that an exported or compiled graph calls it too (eager calls skip the
# op's dispatch: ~20 us, 16 times a sparse step).
one_token_op = torch.library.custom_op("gemma_nb::int8_gemv", _one_token, mutates_args=())
one_token_op.register_fake(lambda x, q, scale: x.new_empty(1, q.shape[0]))


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (q [N, K] * scale [N, 1]).T`` in ``x.dtype``: one bf16 token on the GEMV,
    several on ``torch._weight_int8pack_mm``, anything else upcast (``formats.int8_matmul``)."""
    if not int8pack_usable(x, q):
        return int8_matmul(x, q, scale)
    if x.shape[0] == 1 and x.shape[1] <= GEMV_MAX_K and scale.is_contiguous():
        return one_token_op(x, q, scale) if is_tracing() else _one_token(x, q, scale)
    return torch._weight_int8pack_mm(x, q, scale.reshape(-1).to(x.dtype))
