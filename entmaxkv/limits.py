"""The numeric range EntmaxKV supports, in one place (docs/limits.md).

The constants and the two alpha helpers live here; the other checks that
enforce them live beside the arguments they check (decode, entmax, the
policies) and import these names, so that the documented range and the
enforced one cannot drift apart.
"""
from __future__ import annotations

from ._checks import as_float

__all__ = [
    "ALPHA_MAX", "SOFTMAX_BELOW", "FLOAT64_ABOVE", "POSITION_MAX",
    "check_alpha", "effective_alpha",
]

# alpha in [1, ALPHA_MAX]. Past it the support of a float32 problem can sit
# closer to the row max than float32 can resolve even after the shift, and
# the Gaussian moments' quadrature loses its accuracy guarantee.
ALPHA_MAX = 4.0

# alpha - 1 below this runs as softmax (alpha = 1). There, the entmax map and
# softmax differ by O((alpha - 1) x^2), far below float32 rounding, while
# the entmax formulas divide by alpha - 1 and lose every digit.
SOFTMAX_BELOW = 2.0 ** -33

# alpha above this solves the threshold and builds the probabilities in
# float64 for float16 / bfloat16 / float32 inputs: the support then clusters
# within ~n^(1 - alpha) of the row max in the shifted scores, finer than
# float32 resolves.
FLOAT64_ABOVE = 2.0

# ALiBi positions are converted to float32; integers are exact there up to 2^24.
POSITION_MAX = 2 ** 24


def check_alpha(alpha, name: str = "alpha") -> float:
    """``alpha`` as a Python float in [1, ALPHA_MAX], else ValueError.

    Python and NumPy ints and floats are accepted; bool, strings, tensors
    (reading one would be a host synchronisation), NaN and inf are not. The
    message names ``name`` and the supported range.
    """
    return as_float(alpha, name, lo=1.0, hi=ALPHA_MAX)


def effective_alpha(alpha: float) -> float:
    """The alpha that is run: 1.0 (softmax) when alpha - 1 < SOFTMAX_BELOW, else alpha.

    ``alpha`` must already be checked (a Python float >= 1).
    """
    return 1.0 if alpha - 1.0 < SOFTMAX_BELOW else alpha
