"""Associative-recall (Zoology MQAR) data and metrics."""
from .data import (  # noqa: F401
    DEFAULT_TEST_SEED,
    IGNORE_INDEX,
    MQARSetting,
    accuracy,
    accuracy_by_group,
    accuracy_per_n,
    gap_probabilities,
    make_mqar,
    make_splits,
    derived_test_seed,
    derived_train_seed,
)

__all__ = [
    "DEFAULT_TEST_SEED", "IGNORE_INDEX", "MQARSetting", "accuracy", "accuracy_by_group",
    "accuracy_per_n", "gap_probabilities", "make_mqar", "make_splits", "derived_test_seed", "derived_train_seed",
]
