"""The numeric range EntmaxKV supports, in one place (docs/limits.md).

Constants only here at first; the checks that enforce them live beside the
arguments they check (decode, entmax, the policies) and import these names,
so that the documented range and the enforced one cannot drift apart.
"""
from __future__ import annotations

__all__ = ["ALPHA_MAX", "SOFTMAX_BELOW", "FLOAT64_ABOVE", "POSITION_MAX"]

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
