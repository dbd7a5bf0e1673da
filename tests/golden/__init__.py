"""Golden values: results recorded once, by older code, on one machine (a 2-core AMD EPYC with
AVX2 and no native bf16), that the tests compare today's code against.

Another CPU sums in another order (another vector width, FMA, native bf16 instructions: torch's
kernels, MKL, oneDNN and XLA each pick their code path from the CPU), so a value recorded
elsewhere is compared within float tolerance, never bitwise (issue 38: on an AMD EPYC with
avx512_bf16 the JAX golden read 0.04408497 where it had recorded 0.04408493). Bitwise
comparisons stay between runs on the same machine: a resumed run against an uninterrupted one,
one rank against another, accumix against plain PyTorch/JAX computed in the same test.

The tolerance is set by the precision the golden was trained in, measured by recomputing
``pre_reduce33`` here with other kernels forced (``ATEN_CPU_CAPABILITY=default
MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41``): float32 storage and compute moved by
up to 7.5e-8 (weights up to 0.36), bf16-true by 3.9e-3 (two bf16 steps). A change of what the
code computes (a 16-bit reduction instead of float32, a missed or doubled step) moves them by
1e-4 and more.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# The precision's 16-bit compute or storage: its unit roundoff (machine epsilon).
_HALF_EPS = {"bf16-mixed": 2.0**-7, "bf16-true": 2.0**-7, "fp16-mixed": 2.0**-10}


def matches_golden(expected: Any, got: Any, precision: str = "fp32") -> bool:
    """Whether ``got`` equals the golden ``expected`` up to another CPU's rounding.

    Args:
        expected: the recorded values (a torch tensor, numpy array or nested lists).
        got: this run's values, the same shape.
        precision: the precision word both were trained in: float32 within ``1e-6`` absolute
            plus ``1e-5`` relative; with 16-bit compute or storage within 4 of that dtype's
            epsilon times the largest recorded magnitude.
    """
    e, g = _float64(expected), _float64(got)
    if e.shape != g.shape:
        return False
    if precision not in _HALF_EPS:
        return bool(np.allclose(g, e, rtol=1e-5, atol=1e-6))
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    return bool(np.max(np.abs(g - e), initial=0.0) <= 4 * _HALF_EPS[precision] * scale)


def _float64(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor (bf16 included, which numpy cannot hold)
        return values.detach().double().cpu().numpy()
    return np.asarray(values, dtype=np.float64)
