"""A pass key hidden in real text and asked for at the end (the pass-key retrieval test of Mohtashami & Jaggi 2023,
"Landmark Attention"), on the byte corpus: what a cache that drops tokens loses when the one that matters is far
back.

An example is `length` bytes: a window of corpus text with the needle " The pass key is KEY. Remember it. " at a
chosen depth, then " What is the pass key? The pass key is " and the key up to its last digit. Each of the key's
DIGITS digits follows its own tag byte (bytes 2..6, never in the standard library's sources) wherever the key is
written, and the labels mark the digits, each at its tag's position (where a causal model predicts it). So each
digit is one look-up, tag to digit, the step Zoology's MQAR measures, and a two-layer model learns it on a CPU in
minutes; a digit it then misses through a cache is one the cache dropped. Digits in the filler become FILLER_DIGIT
so the key occurs once before the question.

Trained from scratch at one long length, a two-layer model sits at chance: the one needle hides among hundreds of
filler bytes, so the attention that would find it gets almost no gradient. `train_passkey` grows the length in
stages instead (a curriculum), from near the needle's own length up: at 96 bytes the look-up is learned in a few
hundred steps, and each later stage carries it further (BENCHMARKS.md, issue 36).
"""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from harness.recall.train import TrainConfig, build_recall_model, labelled_logits

NEEDLE = b" The pass key is %s. Remember it. "
QUESTION = b" What is the pass key? The pass key is "
DIGITS = 5
TAGS = bytes(range(2, 2 + DIGITS))  # the byte before each digit of the key
FILLER_DIGIT = ord("#")  # what a digit in the filler text becomes
IGNORE_INDEX = -100  # an unlabelled position (the recall trainer's convention)


def overhead() -> int:
    """Bytes of an example that are not filler: the needle, the question and the answer's fed digits."""
    return len(NEEDLE % tagged(b"0" * DIGITS)) + len(QUESTION) + 2 * DIGITS - 1


def tagged(key: bytes) -> bytes:
    """The key as written: each digit after its tag."""
    return bytes(byte for pair in zip(TAGS, key) for byte in pair)


def passkey_examples(text: np.ndarray, count: int, length: int, seed,
                     depths: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(inputs [count, length], labels [count, length], depth of each needle as a share of the filler before it).
    seed: anything numpy's default_rng takes; text: uint8 bytes to draw filler windows from; depths: where each
    needle goes (0 = the text's start, 1 = just before the question), uniform in [0, 1] when None."""
    filler = length - overhead()
    if filler < 1 or len(text) < filler:
        raise ValueError(f"length {length} leaves {filler} filler bytes (at least 1 needed, and no more than the "
                         f"text's {len(text)}): use length > {overhead()}")
    rng = np.random.default_rng(seed)
    depths = rng.uniform(0, 1, count) if depths is None else np.asarray(depths, dtype=np.float64)
    if depths.shape != (count,) or not ((depths >= 0) & (depths <= 1)).all():
        raise ValueError(f"depths must be {count} shares in [0, 1], got shape {depths.shape}")
    starts = rng.integers(0, len(text) - filler + 1, count)
    inputs = np.empty((count, length), dtype=np.int64)
    labels = np.full((count, length), IGNORE_INDEX, dtype=np.int64)
    for row, (start, depth) in enumerate(zip(starts, depths)):
        key = bytes((rng.permutation(10)[:DIGITS] + ord("0")).tolist())
        window = np.array(text[start:start + filler], dtype=np.int64)
        window[(window >= ord("0")) & (window <= ord("9"))] = FILLER_DIGIT
        cut = round(depth * filler)
        needle = np.frombuffer(NEEDLE % tagged(key), dtype=np.uint8)
        tail = np.frombuffer(QUESTION + tagged(key)[:-1], dtype=np.uint8)
        inputs[row] = np.concatenate([window[:cut], needle, window[cut:], tail])
        labels[row, length - 2 * DIGITS + 1::2] = np.frombuffer(key, dtype=np.uint8)
    return torch.from_numpy(inputs), torch.from_numpy(labels), depths


def answered(hits: torch.Tensor) -> torch.Tensor:
    """Per example, whether every digit was answered: hits bool [count * DIGITS] in row-major order -> [count]."""
    return hits.reshape(-1, DIGITS).all(dim=1)


@dataclass(frozen=True)
class PasskeyTraining:
    arch: str = "gqa"
    d_model: int = 64
    stages: tuple[int, ...] = (96, 112, 128, 160, 192, 256, 384, 512)  # example lengths, trained in this order
    min_steps: int = 200  # per stage
    max_steps: int = 2000  # per stage: the first look-up can take a while to appear (a plateau, then a jump)
    learned_loss: float = 0.3  # a stage ends once its last LOSS_WINDOW steps' mean loss is below this (a guess among
    # the ten digits: ln 10 = 2.30)
    batch_size: int = 64
    lr: float = 2e-3
    seed: int = 0


LOSS_WINDOW = 50  # steps
CHUNK = 100  # batches drawn at once (a stage's examples are drawn as it goes, not all up front)


def train_passkey(training: PasskeyTraining, text: np.ndarray, progress=print) -> torch.nn.Module:
    """A two-layer byte model (the recall recipe: no MLP, tied embeddings) trained on pass keys in `text`,
    cross-entropy on the key's digits only, each stage on fresh examples until its loss is learned_loss or
    max_steps pass; progress(stage length, steps, mean loss of its last steps) after each stage. Raises if a stage
    ends unlearned: the next ones would only train on noise."""
    torch.manual_seed(training.seed)
    config = TrainConfig(arch=training.arch, d_model=training.d_model, lr=training.lr)
    model = build_recall_model(config, 256, max(training.stages)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.lr, weight_decay=config.weight_decay)
    for stage, length in enumerate(training.stages):
        losses = []
        for inputs, labels in stage_batches(training, text, stage, length):
            logits, targets, _ = labelled_logits(model, inputs, labels)
            loss = F.cross_entropy(logits, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) >= training.max_steps or (len(losses) >= training.min_steps and
                                                     recent_mean(losses) < training.learned_loss):
                break
        progress(length, len(losses), recent_mean(losses))
        if recent_mean(losses) >= training.learned_loss:
            raise RuntimeError(f"pass-key training did not learn length {length} in {len(losses)} steps (mean loss "
                               f"{recent_mean(losses):.3f}, learned below {training.learned_loss}): try another seed "
                               f"or lr")
    return model.eval()


def recent_mean(losses: list[float]) -> float:
    return sum(losses[-LOSS_WINDOW:]) / min(LOSS_WINDOW, len(losses))


def stage_batches(training: PasskeyTraining, text: np.ndarray, stage: int, length: int):
    """A stage's training batches, endless, drawn CHUNK at a time from a seed of (seed, stage, chunk)."""
    chunk = 0
    while True:
        inputs, labels, _ = passkey_examples(text, CHUNK * training.batch_size, length,
                                             seed=[training.seed, stage, chunk])
        yield from zip(inputs.split(training.batch_size), labels.split(training.batch_size))
        chunk += 1
