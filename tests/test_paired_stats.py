"""The paired comparison behind the quality tables: mean difference, its (cluster-robust) standard error, McNemar."""
import math

import numpy as np
import pytest

from harness.paired_stats import mcnemar_p, paired_difference


def test_one_sample_per_cluster_is_the_plain_standard_error():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=50), rng.normal(size=50)
    d = a - b
    mean, se = paired_difference(a, b, clusters=list(range(50)))
    assert mean == pytest.approx(d.mean())
    assert se == pytest.approx(d.std(ddof=1) / math.sqrt(50))
    assert paired_difference(a, b) == pytest.approx((mean, se))


def test_equal_clusters_give_the_standard_error_of_their_means():
    # with G clusters of m samples each, the cluster-robust error is that of the G cluster means taken as samples
    rng = np.random.default_rng(1)
    groups, size = 12, 7
    effects = np.repeat(rng.normal(size=groups), size)  # what the samples of one cluster share
    a, b = effects + rng.normal(scale=0.3, size=groups * size), rng.normal(scale=0.3, size=groups * size)
    clusters = np.repeat([f"file{i}" for i in range(groups)], size)
    means = (a - b).reshape(groups, size).mean(axis=1)
    mean, se = paired_difference(a, b, clusters)
    assert mean == pytest.approx(means.mean())
    assert se == pytest.approx(means.std(ddof=1) / math.sqrt(groups))
    assert se > 2 * paired_difference(a, b)[1]  # the per-sample error misses what a cluster shares


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="at least 2 samples"):
        paired_difference([1.0], [0.0])
    with pytest.raises(ValueError, match="3 clusters for 2 samples"):
        paired_difference([1.0, 2.0], [0.0, 0.0], clusters=[0, 1, 2])
    with pytest.raises(ValueError, match="one cluster"):
        paired_difference([1.0, 2.0], [0.0, 0.0], clusters=["a", "a"])


def test_mcnemar_exact_p():
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(0, 5) == pytest.approx(2 / 32)  # both tails of five fair coins all landing one way
    assert mcnemar_p(3, 7) == mcnemar_p(7, 3) == pytest.approx(2 * sum(math.comb(10, i) for i in range(4)) / 1024)
