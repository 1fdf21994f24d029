"""Comparing two variants measured on the same samples (e.g. two quantizations on the same prompts or queries)."""
import math
from collections.abc import Hashable, Sequence

import numpy as np


def paired_difference(a: Sequence[float], b: Sequence[float],
                      clusters: Sequence[Hashable] | None = None) -> tuple[float, float]:
    """Mean of a - b over paired samples and its standard error. Given each sample's cluster (e.g. the file a prompt
    was drawn from), the error is cluster-robust (Liang and Zeger 1986, with the G / (G - 1) small-sample factor):
    samples of one cluster may move together, so the error counts clusters, not samples. With one sample per cluster
    it is the usual s / sqrt(n)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if len(d) < 2:
        raise ValueError(f"a paired difference needs at least 2 samples, got {len(d)}")
    if clusters is None:
        return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))
    if len(clusters) != len(d):
        raise ValueError(f"got {len(clusters)} clusters for {len(d)} samples; give one per sample")
    _, index = np.unique(np.asarray(clusters), return_inverse=True)
    groups = np.bincount(index, weights=d - d.mean())  # each cluster's summed deviation
    if len(groups) < 2:
        raise ValueError("every sample is in one cluster: its standard error cannot be estimated (need 2 or more)")
    return float(d.mean()), float(math.sqrt(len(groups) / (len(groups) - 1) * (groups ** 2).sum()) / len(d))


def mcnemar_p(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p: under 'no difference' each discordant sample is a fair coin."""
    n, k = only_a + only_b, min(only_a, only_b)
    return 1.0 if n == 0 else min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)
