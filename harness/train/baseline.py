"""The unigram baseline a byte-level model must beat: byte frequencies of the train split with add-one smoothing,
scored on the validation split."""
import numpy as np


def unigram_bpb(train: np.ndarray, validation: np.ndarray) -> float:
    """Cross-entropy of `validation` under the add-one-smoothed byte distribution of `train`, in bits per byte."""
    if len(validation) == 0:
        raise ValueError("the unigram baseline needs a non-empty validation split")
    counts = np.bincount(train, minlength=256) + 1.0
    log2_p = np.log2(counts / counts.sum())
    return float(-(np.bincount(validation, minlength=256) * log2_p).sum() / len(validation))
