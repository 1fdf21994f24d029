"""`zoo train`: any registry architecture as a byte-level LM on local text (the Python standard library's sources by
default), with a unigram baseline, validation bits per byte, resumable checkpoints and a time budget."""
from harness.train.baseline import unigram_bpb
from harness.train.corpus import Corpus, load_corpus, training_batch, validation_windows
from harness.train.settings import TrainSettings
from harness.train.trainer import run_train

__all__ = ["Corpus", "TrainSettings", "load_corpus", "run_train", "training_batch", "unigram_bpb", "validation_windows"]
