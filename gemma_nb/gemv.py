"""One token's matmul on the cpu at the speed of memory (notebook 07), int8 weights with NxD's
numerics (an fp32 scale per output row, bf16 activations) and bf16 weights: a small C GEMV built
here on first use where ATen runs AVX2 or AVX-512; other shapes and cpus fall back to torch."""

import ctypes
import functools
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from gemma_nb.formats import int8_matmul


def is_tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


# torch._weight_int8pack_mm's AVX-512 kernel reads K 16 at a time, aligned, no tail (else wrong
# numbers or a crash).
INT8PACK_K_MULTIPLE = 16
INT8PACK_ALIGN_BYTES = 32
# The GEMV keeps one fp32 copy of the activations on its stack.
GEMV_MAX_K = 16384

# Hand-written because no library kernel streams one token's weights at memory speed on one AVX2
# core. int8: ATen's tinygemm does 4 output rows of 8 lanes and multiplies the scale into every
# weight (~8 GB/s even from cache); torchao's int8 weight-only tensor and inductor's compiled
# dequantize-matmul (max-autotune) run slower than bf16. bf16: ATen's GEMV and inductor's reach ~9
# GB/s on one thread, and oneDNN's packed bf16 linear refuses a cpu without AVX-512 BW or
# AVX-NE-CONVERT. This one sums in fp32, scales the sum once, rounds it to bf16 once, and prefetches
# ahead: 4 rows x 16 columns a step, or rows under 2 kB one at a time x 64 (which stream faster so:
# 704-byte int8 rows took 1.3x the read probe's time, against 1.7-1.9x 4 at a time).
GEMV_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define LOAD_INT8(p) \
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define LOAD_BF16(p) _mm256_castsi256_ps( \
    _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOAD(bf16, p) ((bf16) ? LOAD_BF16(p) : LOAD_INT8(p))

static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

static uint16_t to_bf16(float f) {  /* round to nearest even, as torch casts */
    uint32_t b;
    memcpy(&b, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

/* Row i of x (row 0 where x_stride is 0) against matrix ids[i] of the stacked w [E, n, k], int8 or
   (bf16 = 1) bf16, rows scaled by scale [E, n] (NULL: none): y [count, n] bf16, the fp32 sum
   rounded once. n % 4 == 0, k % 16 == 0. Inlined with bf16 a constant, so each loop is one kind. */
static inline __attribute__((always_inline)) void gemv_of(
    const uint16_t *x, long x_stride, const void *w, int bf16, const float *scale,
    const int64_t *ids, long count, uint16_t *y, long n, long k) {
    long width = bf16 ? 2 : 1, row_bytes = k * width;
    float xf[k];
    for (long i = 0; i < count; i++, y += n) {
        const char *m = (const char *)w + ids[i] * n * row_bytes;
        const float *s = scale ? scale + ids[i] * n : NULL;
        for (long j = 0; j < k; j++) {
            uint32_t b = (uint32_t)x[i * x_stride + j] << 16;
            memcpy(&xf[j], &b, 4);
        }
        for (long r0 = 0; row_bytes >= 2048 && r0 < n; r0 += 4) {
            __m256 acc[4][2];
            for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
            for (long j = 0; j < k; j += 16) {
                __m256 x0 = _mm256_loadu_ps(xf + j), x1 = _mm256_loadu_ps(xf + j + 8);
                for (int r = 0; r < 4; r++) {
                    const char *p = m + (r0 + r) * row_bytes + j * width;
                    _mm_prefetch(p + 8 * row_bytes, _MM_HINT_T0);  /* 8 rows ahead */
                    acc[r][0] = _mm256_fmadd_ps(x0, LOAD(bf16, p), acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(x1, LOAD(bf16, p + 8 * width), acc[r][1]);
                }
            }
            for (int r = 0; r < 4; r++) {
                float sum = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
                y[r0 + r] = to_bf16(s ? sum * s[r0 + r] : sum);
            }
        }
        for (long r = 0; row_bytes < 2048 && r < n; r++) {  /* 64 columns a step */
            const char *row = m + r * row_bytes;
            __m256 acc[8];
            for (int q = 0; q < 8; q++) acc[q] = _mm256_setzero_ps();
            long j = 0;
            for (; j + 64 <= k; j += 64) {
                const char *p = row + j * width;
                _mm_prefetch(p + 8 * row_bytes, _MM_HINT_T0);
                if (bf16) _mm_prefetch(p + 8 * row_bytes + 64, _MM_HINT_T0);
                for (int q = 0; q < 8; q++)
                    acc[q] = _mm256_fmadd_ps(
                        _mm256_loadu_ps(xf + j + 8 * q), LOAD(bf16, p + 8 * q * width), acc[q]);
            }
            for (; j < k; j += 8) {
                __m256 wj = LOAD(bf16, row + j * width);
                acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + j), wj, acc[0]);
            }
            for (int q = 1; q < 8; q++) acc[0] = _mm256_add_ps(acc[0], acc[q]);
            y[r] = to_bf16(s ? hsum(acc[0]) * s[r] : hsum(acc[0]));
        }
    }
}

void gemv(const uint16_t *x, long x_stride, const void *w, int bf16, const float *scale,
          const int64_t *ids, long count, uint16_t *y, long n, long k) {
    if (bf16) gemv_of(x, x_stride, w, 1, scale, ids, count, y, n, k);
    else gemv_of(x, x_stride, w, 0, scale, ids, count, y, n, k);
}
"""


@functools.cache
def _gemv_library():
    """The GEMV built for this cpu (None where it has no AVX2, or no C compiler is found)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    capability = torch.backends.cpu.get_cpu_capability()
    if compiler is None or capability not in ("AVX2", "AVX512") or platform.machine() != "x86_64":
        return None
    with tempfile.TemporaryDirectory(prefix="gemma_nb_gemv_") as folder:
        source, library = Path(folder) / "gemv.c", Path(folder) / "gemv.so"
        source.write_text(GEMV_SOURCE)
        flags = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC"]
        built = subprocess.run(
            [compiler, *flags, "-o", str(library), str(source)], capture_output=True
        )
        if built.returncode != 0:
            return None
        # dlopen maps the file: deleting the folder afterwards keeps the function
        gemv = ctypes.CDLL(str(library)).gemv
    gemv.restype = None
    gemv.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    gemv.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_void_p] + [ctypes.c_long] * 2
    return gemv


def kernel_name() -> str:
    """The kernel one bf16 token's int8 and bf16 matmuls run on this machine."""
    if _gemv_library() is None:
        return "torch (_weight_int8pack_mm, linear)"
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


def usable(x: torch.Tensor, w: torch.Tensor, count: int = 1) -> bool:
    """Whether the GEMV (built here) takes ``x [1 or count, K]`` against ``w [..., N, K]``: cpu,
    bf16 ``x``, bf16 or int8 ``w``, both contiguous, N % 4 == 0 and K % 16 == 0."""
    return (
        x.dim() == 2
        and x.shape[0] in (1, count)
        and x.shape[1] == w.shape[-1] <= GEMV_MAX_K
        and x.shape[1] % 16 == 0
        and w.shape[-2] % 4 == 0
        and x.dtype == torch.bfloat16
        and w.dtype in (torch.bfloat16, torch.int8)
        and x.device.type == w.device.type == "cpu"
        and x.is_contiguous()
        and w.is_contiguous()
        and _gemv_library() is not None
    )


def _gemv(
    x: torch.Tensor, w: torch.Tensor, ids: list[int], scale: torch.Tensor | None
) -> torch.Tensor:
    count, (n, k) = len(ids), w.shape[-2:]
    out = torch.empty(count, n, dtype=x.dtype)
    x_stride, bf16 = 0 if x.shape[0] == 1 else k, w.dtype == torch.bfloat16
    scale_ptr = None if scale is None else scale.data_ptr()
    id_array = (ctypes.c_int64 * count)(*ids)
    _gemv_library()(
        x.data_ptr(), x_stride, w.data_ptr(), bf16, scale_ptr, id_array, count, out.data_ptr(), n, k
    )
    return out


# The GEMV as a torch op, so that an exported or compiled graph calls it too (eager calls skip the
# op's dispatch: ~20 us a call).
gemv_op = torch.library.custom_op("gemma_nb::gemv", _gemv, mutates_args=())
gemv_op.register_fake(lambda x, w, ids, scale: x.new_empty(len(ids), w.shape[-2]))


def gemv(x: torch.Tensor, w: torch.Tensor, ids=(0,), scale: torch.Tensor | None = None):
    """Row i of ``x [1 or len(ids), K]`` (row 0 where one) against matrix ``ids[i]`` of the stacked
    ``w [E, N, K]`` (``[N, K]``: E = 1), its rows scaled by ``scale [E, N, 1]`` (contiguous, or
    None): ``[len(ids), N]`` bf16, where ``usable``."""
    return (gemv_op if is_tracing() else _gemv)(x, w, list(ids), scale)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (q [N, K] * scale [N, 1]).T`` in ``x.dtype``: one bf16 token on the GEMV,
    several on ``torch._weight_int8pack_mm``, anything else upcast (``formats.int8_matmul``)."""
    if usable(x, q) and scale.is_contiguous():
        return gemv(x, q, scale=scale)
    if int8pack_usable(x, q):
        return torch._weight_int8pack_mm(x, q, scale.reshape(-1).to(x.dtype))
    return int8_matmul(x, q, scale)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)``, on the GEMV where ``usable`` (one cpu bf16 token, bf16 ``w``)."""
    return gemv(x, w) if w.dtype == torch.bfloat16 and usable(x, w) else F.linear(x, w)
