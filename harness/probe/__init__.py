"""Synthetic probe tasks (MAD-Lab's six, parity, the S5 / A5 word problems): settings and seeded generators."""
from .common import IGNORE_INDEX, SPLITS  # noqa: F401
from .copying import CompressionSetting, SelectiveCopySetting, make_compression, make_selective_copy  # noqa: F401
from .fuzzy_recall import FuzzyRecallSetting, make_fuzzy_recall  # noqa: F401
from .memorization import MemorizationSetting, make_memorization, memorization_map  # noqa: F401
from .recall import RecallSetting, make_recall  # noqa: F401
from .state_tracking import (  # noqa: F401
    GROUPS,
    ParitySetting,
    WordProblemSetting,
    composition_table,
    group_elements,
    make_parity,
    make_word_problem,
)
from .tasks import (  # noqa: F401
    BASELINES,
    CHANGES,
    DEFAULT_NUM_TRAIN_EXAMPLES,
    NUM_TEST_EXAMPLES,
    NUM_TRAIN_EXAMPLES,
    Variant,
    make_examples,
    variants,
)

__all__ = [
    "IGNORE_INDEX", "SPLITS", "CompressionSetting", "SelectiveCopySetting", "make_compression", "make_selective_copy",
    "FuzzyRecallSetting", "make_fuzzy_recall", "MemorizationSetting", "make_memorization", "memorization_map",
    "RecallSetting", "make_recall", "GROUPS", "ParitySetting", "WordProblemSetting", "composition_table",
    "group_elements", "make_parity", "make_word_problem", "BASELINES", "CHANGES", "DEFAULT_NUM_TRAIN_EXAMPLES",
    "NUM_TEST_EXAMPLES", "NUM_TRAIN_EXAMPLES", "Variant", "make_examples", "variants",
]
