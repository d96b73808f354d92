"""Small statistics helpers (no scipy): chi-square tests with a 0.1% critical value."""

from __future__ import annotations

import math


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: the 0.999 one)."""
    df = max(1, df)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_goodness_of_fit(probs: dict, counts: dict, n: int, min_expected: float = 5.0) -> tuple[float, float]:
    """Pearson statistic of `counts` (n draws) against exact `probs`, cells with expected
    count below `min_expected` pooled; returns (statistic, 0.1% critical value)."""
    stat, pooled_e, pooled_o, cells = 0.0, 0.0, 0, 0
    for key, p in probs.items():
        e, o = p * n, counts.get(key, 0)
        if e < min_expected:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
        else:
            stat, cells = stat + (o - e) ** 2 / e, cells + 1
    if pooled_e > 0:
        stat, cells = stat + (pooled_o - pooled_e) ** 2 / pooled_e, cells + 1
    return stat, chi2_critical(cells - 1)


def chi2_homogeneity(a: dict, b: dict, min_expected: float = 5.0) -> tuple[float, float, int]:
    """Two-sample test that counts `a` and `b` come from one distribution (cells with
    expected count below `min_expected` pooled); returns (statistic, 0.1% critical, df)."""
    na, nb = sum(a.values()), sum(b.values())
    n = na + nb
    stat, cells, pool_a, pool_b = 0.0, 0, 0, 0
    for key in set(a) | set(b):
        oa, ob = a.get(key, 0), b.get(key, 0)
        ea, eb = (oa + ob) * na / n, (oa + ob) * nb / n
        if min(ea, eb) < min_expected:
            pool_a, pool_b = pool_a + oa, pool_b + ob
            continue
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
        cells += 1
    if pool_a + pool_b:
        ea, eb = (pool_a + pool_b) * na / n, (pool_a + pool_b) * nb / n
        if min(ea, eb) > 0:
            stat += (pool_a - ea) ** 2 / ea + (pool_b - eb) ** 2 / eb
            cells += 1
    df = max(1, cells - 1)
    return stat, chi2_critical(df), df
