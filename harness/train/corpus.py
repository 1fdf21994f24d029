"""The byte-level training corpus: local text split into train and validation, batches drawn from it by seed.

Default: real text every machine has without a download, the running interpreter's standard library sources: every
.py file under sysconfig's "stdlib" path, leaving out site-packages and dist-packages (installed packages differ
between machines). On CPython 3.11.7 that is 1,790 files, 31.5 MB.

Split by file: a file is validation when sha256 of its relative path (posix form), read as a fraction of 2**64 from
its first 8 bytes, is below VALIDATION_SHARE (5%), so a file's side does not depend on what else is in the folder.
The standard library above: train 1,704 files, 29.7 MB; validation 86 files, 1.8 MB. Files are concatenated in
sorted relative-path order within each split, so a window may cross from one file into the next. A folder
(`--corpus DIR`) is split the same way over every file under it outside hidden (dot) folders; if no file's hash falls
below the share, the non-empty file with the lowest hash is validation. A single file (`--corpus FILE`) is split by
byte offset: its last 5% is validation.

Tokens are the raw bytes, ids 0..255. Training batches are random windows whose generator is seeded from (seed,
step), so a resumed run draws exactly the batches an uninterrupted one would; validation windows are drawn once by a
fixed seed, the same for every run and architecture on the same corpus.
"""
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VALIDATION_SHARE = 0.05
INSTALLED = ("site-packages", "dist-packages")  # a machine's installed packages, not the standard library
VALIDATION_SEED = 0  # one fixed set of validation windows per (corpus, count, length)


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint8 bytes of the training split
    validation: np.ndarray  # uint8 bytes of the validation split
    description: dict  # source, path, files and bytes per split: recorded with results, checked on resume
    # per split ("train", "validation"): its files' names in order and where each ends (bytes, cumulative), so a
    # window's file can be told (samples drawn from one file are not independent of each other)
    file_names: dict[str, tuple[str, ...]]
    file_ends: dict[str, np.ndarray]

    def files_at(self, side: str, offsets: np.ndarray) -> np.ndarray:
        """Index (into file_names[side]) of the file holding each byte offset of split `side`."""
        return np.searchsorted(self.file_ends[side], np.asarray(offsets), side="right")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.py") if p.is_file() and not set(p.relative_to(root).parts) & set(INSTALLED)]


def folder_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)]


def hash_fraction(relative: str) -> float:
    """Where a file's relative path hashes to in [0, 1): below VALIDATION_SHARE means validation."""
    return int.from_bytes(hashlib.sha256(relative.encode()).digest()[:8], "big") / 2**64


def check_corpus_path(path: Path | None) -> None:
    """A corpus path names a non-empty file, or a folder with a non-empty file in it (None: the standard library);
    checked before any model is built."""
    if path is None:
        return
    path = Path(path)
    if not path.exists():
        raise ValueError(f"corpus {str(path)!r} does not exist (pass a text file or a folder of them)")
    if path.is_file() and path.stat().st_size == 0:
        raise ValueError(f"corpus file {str(path)!r} is empty")
    if path.is_dir() and not any(p.stat().st_size for p in folder_files(path)):
        raise ValueError(f"corpus folder {str(path)!r} holds no non-empty file outside hidden folders")
    if not path.is_file() and not path.is_dir():
        raise ValueError(f"corpus {str(path)!r} is neither a file nor a folder")


def load_corpus(path: Path | None = None) -> Corpus:
    """The corpus at `path` (a file or a folder), or the standard library sources when None."""
    check_corpus_path(path)
    if path is not None and Path(path).is_file():
        return file_corpus(Path(path))
    root = stdlib_root() if path is None else Path(path)
    files = stdlib_files(root) if path is None else folder_files(root)
    return folder_corpus(root, files, "python stdlib (.py)" if path is None else "folder")


def folder_corpus(root: Path, files: list[Path], source: str) -> Corpus:
    texts = {p.relative_to(root).as_posix(): p.read_bytes() for p in files}
    if sum(1 for text in texts.values() if text) < 2:
        raise ValueError(f"corpus folder {str(root)!r} holds fewer than 2 non-empty files; a by-file split needs at "
                         f"least 2 (pass a single file as --corpus FILE: it is split by byte offset)")
    fractions = {relative: hash_fraction(relative) for relative in texts}
    held_out = ({r for r, f in fractions.items() if f < VALIDATION_SHARE}
                or {min((r for r in texts if texts[r]), key=fractions.get)})  # no file hashed low: the lowest non-empty
    names = {side: tuple(r for r in sorted(texts) if (r in held_out) == side) for side in (False, True)}
    train, validation = (np.frombuffer(b"".join(texts[r] for r in names[side]), dtype=np.uint8) for side in (False, True))
    return Corpus(train, validation, {
        "source": source, "path": str(root.resolve()), "train_files": len(names[False]),
        "validation_files": len(names[True]), "train_bytes": len(train), "validation_bytes": len(validation)},
        {"train": names[False], "validation": names[True]},
        {"train": np.cumsum([len(texts[r]) for r in names[False]]),
         "validation": np.cumsum([len(texts[r]) for r in names[True]])})


def file_corpus(path: Path) -> Corpus:
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    cut = len(data) - round(len(data) * VALIDATION_SHARE)
    return Corpus(data[:cut], data[cut:], {
        "source": "file", "path": str(path.resolve()), "train_files": 1, "validation_files": 1,
        "train_bytes": cut, "validation_bytes": len(data) - cut},
        {"train": (path.name,), "validation": (path.name,)},
        {"train": np.array([cut]), "validation": np.array([len(data) - cut])})


def check_window_fits(corpus: Corpus, length: int) -> None:
    """Both splits hold at least one window of `length` bytes."""
    for side in ("train", "validation"):
        size = corpus.description[f"{side}_bytes"]
        if size < length:
            raise ValueError(f"the corpus's {side} split holds {size} bytes, fewer than one window of {length} "
                             f"(context + 1); use a larger corpus or a shorter context")


def window_starts(size: int, count: int, length: int, generator: np.random.Generator) -> np.ndarray:
    """`count` uniformly random offsets of `length`-byte windows in `size` bytes."""
    return generator.integers(0, size - length + 1, size=count)


def windows_at(data: np.ndarray, starts: np.ndarray, length: int) -> torch.Tensor:
    """The windows of `length` bytes at `starts`, as token ids [len(starts), length]."""
    return torch.from_numpy(data[starts[:, None] + np.arange(length)].astype(np.int64))


def training_starts(corpus: Corpus, seed: int, step: int, batch_size: int, length: int) -> np.ndarray:
    """Where step `step`'s batch windows start in the training split: drawn by a generator seeded from (seed, step)."""
    return window_starts(len(corpus.train), batch_size, length, np.random.default_rng([seed, step]))


def training_batch(corpus: Corpus, seed: int, step: int, batch_size: int, length: int) -> torch.Tensor:
    """Step `step`'s batch: drawn by a generator seeded from (seed, step) alone."""
    return windows_at(corpus.train, training_starts(corpus, seed, step, batch_size, length), length)


def validation_starts(corpus: Corpus, count: int, length: int) -> np.ndarray:
    """Where the fixed validation windows start in the validation split."""
    return window_starts(len(corpus.validation), count, length, np.random.default_rng(VALIDATION_SEED))


def validation_windows(corpus: Corpus, count: int, length: int) -> torch.Tensor:
    """The fixed validation set: the same windows at every evaluation, for every run on this corpus."""
    return windows_at(corpus.validation, validation_starts(corpus, count, length), length)
