"""Multi-query associative recall (MQAR) data, following Zoology's generator.

Semantics (Zoology, Arora et al. 2023, ``zoology/data/multiquery_ar.py``):

* keys are drawn from ids ``1 .. V//2 - 1`` and values from ``V//2 .. V - 1``,
  ``N`` of each without replacement per example;
* the sequence starts with ``k1 v1 ... kN vN``; the remaining ``L - 2N``
  positions form ``(L - 2N) / 2`` two-token slots. Key ``j`` is written at
  offset ``2 * gap_j`` after the KV block, the gaps drawn without replacement
  with ``p_i ∝ a * i**(a - 1)`` (``i = gap + 1``), so for a = 0.01 queries
  cluster just after the KV block;
* filler is 0; with ``random_non_queries`` every 0 of the input is replaced by a
  token drawn uniformly from ``0 .. V - 1`` (as in Zoology: the draw may be 0
  again, or equal any key or value of the example);
* Zoology builds ``L + 1`` tokens, labels the token *after* each query key with
  its value, and shifts (inputs = tokens[:-1], labels = labels[1:]). The net
  effect, reproduced here directly: ``labels[t] = value`` at the input position
  ``t`` holding the query key, ``-100`` elsewhere. The value is not in the input
  after the query (the next input token is filler).

Randomness comes only from a ``torch.Generator`` seeded with ``seed``, so a
(setting, num_examples, seed) triple always yields the same tensors.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, Hashable, Sequence, Tuple

import torch

IGNORE_INDEX = -100
# Test sets depend only on the setting and this seed, never on the run's seed
# or on which other settings are in the run.
DEFAULT_TEST_SEED = 1234


@dataclass(frozen=True)
class MQARSetting:
    seq_len: int
    num_kv_pairs: int
    vocab_size: int = 8192
    power_a: float = 0.01
    random_non_queries: bool = True

    def validate(self) -> "MQARSetting":
        L, N, V, a = self.seq_len, self.num_kv_pairs, self.vocab_size, self.power_a
        for name, v in (("seq_len", L), ("num_kv_pairs", N), ("vocab_size", V)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name}={v!r}: must be an int")
        if N < 1:
            raise ValueError(f"num_kv_pairs={N}: must be >= 1")
        if L < 1 or L % 2 != 0:
            raise ValueError(f"seq_len={L}: must be a positive even number "
                             "(the query region is made of two-token slots)")
        if 4 * N > L:
            raise ValueError(f"num_kv_pairs={N} too large for seq_len={L}: "
                             f"2N + 2N > L ({2 * N} KV tokens + {2 * N} query-slot "
                             f"tokens = {4 * N} > {L})")
        if V <= L:
            raise ValueError(f"vocab_size={V} must be > seq_len={L}")
        if V // 2 - 1 < N:
            raise ValueError(f"vocab_size={V} too small: keys need num_kv_pairs={N} "
                             f"distinct ids in 1..{V // 2 - 1}")
        if V - V // 2 < N:
            raise ValueError(f"vocab_size={V} too small: values need num_kv_pairs={N} "
                             f"distinct ids in {V // 2}..{V - 1}")
        if not (isinstance(a, (int, float)) and a > 0):
            raise ValueError(f"power_a={a!r}: must be > 0 (p_i ∝ a·i^(a-1))")
        return self

    @property
    def num_slots(self) -> int:
        """Number of two-token query slots after the KV block."""
        return (self.seq_len - 2 * self.num_kv_pairs) // 2


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) % (2 ** 63))
    return g


def sample_distinct(g: torch.Generator, n: int, k: int, low: int, high: int) -> torch.Tensor:
    """[n, k] ids, each row k distinct ids uniform from low..high-1, in random order.

    Floyd's subset algorithm vectorised over rows (k steps of O(n*k)), then a
    random permutation of each row, so memory does not scale with the range.
    """
    m = high - low
    out = torch.empty(n, k, dtype=torch.long)
    for i, j in enumerate(range(m - k, m)):
        t = torch.randint(0, j + 1, (n,), generator=g)
        if i:
            taken = (out[:, :i] == t.unsqueeze(1)).any(dim=1)
            t = torch.where(taken, torch.full_like(t, j), t)
        out[:, i] = t
    perm = torch.rand(n, k, generator=g).argsort(dim=1)
    return out.gather(1, perm) + low


def gap_probabilities(setting: MQARSetting) -> torch.Tensor:
    """p over query slots 0..num_slots-1: p_i ∝ a·i^(a-1) with i = slot + 1."""
    a = float(setting.power_a)
    i = torch.arange(1, setting.num_slots + 1, dtype=torch.float64)
    p = a * i ** (a - 1)
    return p / p.sum()


def _sample_gaps(g: torch.Generator, n: int, setting: MQARSetting) -> torch.Tensor:
    """[n, N] distinct slots per row, successive sampling without replacement
    with weights p (what numpy's choice(replace=False, p=p) draws), done with
    the Gumbel-top-k trick."""
    logp = gap_probabilities(setting).log()
    u = torch.rand(n, setting.num_slots, generator=g, dtype=torch.float64)
    u = u.clamp_min(torch.finfo(torch.float64).tiny)
    scores = logp - torch.log(-torch.log(u))
    return scores.topk(setting.num_kv_pairs, dim=1).indices


def make_mqar(setting: MQARSetting, num_examples: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), LongTensors of shape [num_examples, seq_len]."""
    setting.validate()
    if num_examples < 0:
        raise ValueError(f"num_examples={num_examples}: must be >= 0")
    L, N, V = setting.seq_len, setting.num_kv_pairs, setting.vocab_size
    n = int(num_examples)
    g = _generator(seed)

    keys = sample_distinct(g, n, N, 1, V // 2)
    values = sample_distinct(g, n, N, V // 2, V)
    gaps = _sample_gaps(g, n, setting)

    inputs = torch.zeros(n, L, dtype=torch.long)
    inputs[:, 0:2 * N:2] = keys
    inputs[:, 1:2 * N:2] = values
    query_pos = 2 * N + 2 * gaps
    inputs.scatter_(1, query_pos, keys)

    labels = torch.full((n, L), IGNORE_INDEX, dtype=torch.long)
    labels.scatter_(1, query_pos, values)

    if setting.random_non_queries:
        filler = torch.randint(0, V, (n, L), generator=g)
        inputs = torch.where(inputs == 0, filler, inputs)
    return inputs, labels


def _derived_seed(kind: str, base: int, setting: MQARSetting, index: int | None) -> int:
    """63-bit seed from a hash; train seeds are even, test seeds odd, so a
    train set and a test set can never share a seed."""
    key = repr((kind, int(base), setting.seq_len, setting.num_kv_pairs, setting.vocab_size,
                float(setting.power_a), bool(setting.random_non_queries), index))
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 2
    return 2 * h + (1 if kind == "test" else 0)


def derived_train_seed(setting: MQARSetting, index: int, seed: int) -> int:
    return _derived_seed("train", seed, setting, index)


def derived_test_seed(setting: MQARSetting, seed: int = DEFAULT_TEST_SEED) -> int:
    return _derived_seed("test", seed, setting, None)


def _pad(t: torch.Tensor, length: int, value: int) -> torch.Tensor:
    if t.shape[1] == length:
        return t
    out = torch.full((t.shape[0], length), value, dtype=t.dtype)
    out[:, :t.shape[1]] = t
    return out


def make_splits(
    train_settings: Sequence[Tuple[MQARSetting, int]],
    test_settings: Sequence[Tuple[MQARSetting, int]],
    seed: int,
    test_seed_base: int = DEFAULT_TEST_SEED,
):
    """Build a mixed, shuffled train set and one test set per setting.

    Returns ``(train, test)``:
      * ``train = (inputs, labels, setting_index)``; ``setting_index[i]`` is the
        index into ``train_settings`` of example i. If the settings have
        different seq_len, shorter sequences are right-padded (input 0,
        label -100) to the longest.
      * ``test = [(inputs, labels), ...]`` aligned with ``test_settings``. Each
        test set depends only on its setting, its size and ``test_seed_base``
        (not on ``seed`` nor on the other settings in the run).

    Train seeds (even) and test seeds (odd) are derived so they never coincide.
    """
    parts_in, parts_lab, parts_idx = [], [], []
    for idx, (s, n) in enumerate(train_settings):
        x, y = make_mqar(s, n, derived_train_seed(s, idx, seed))
        parts_in.append(x)
        parts_lab.append(y)
        parts_idx.append(torch.full((n,), idx, dtype=torch.long))
    if parts_in:
        L = max(p.shape[1] for p in parts_in)
        tr_in = torch.cat([_pad(p, L, 0) for p in parts_in])
        tr_lab = torch.cat([_pad(p, L, IGNORE_INDEX) for p in parts_lab])
        tr_idx = torch.cat(parts_idx)
        perm = torch.randperm(tr_in.shape[0], generator=_generator(derived_train_seed(
            MQARSetting(0, 0), -1, seed)))
        tr_in, tr_lab, tr_idx = tr_in[perm], tr_lab[perm], tr_idx[perm]
    else:
        tr_in = torch.empty(0, 0, dtype=torch.long)
        tr_lab = torch.empty(0, 0, dtype=torch.long)
        tr_idx = torch.empty(0, dtype=torch.long)
    test = [make_mqar(s, n, derived_test_seed(s, test_seed_base)) for s, n in test_settings]
    return (tr_in, tr_lab, tr_idx), test


def accuracy(predictions: torch.Tensor, labels: torch.Tensor) -> Dict[str, float]:
    """Accuracy over labelled positions (labels != -100).

    ``per_example``: fraction correct per example, averaged over examples that
    have at least one labelled position (the section-4 metric);
    ``per_token``: fraction correct over all labelled positions.
    """
    if predictions.shape != labels.shape:
        raise ValueError(f"predictions {tuple(predictions.shape)} vs labels {tuple(labels.shape)}")
    mask = labels != IGNORE_INDEX
    correct = (predictions == labels) & mask
    n_lab = mask.sum(dim=1)
    has = n_lab > 0
    n_tok = int(n_lab.sum())
    per_example = (correct.sum(dim=1)[has].double() / n_lab[has].double()).mean().item() \
        if bool(has.any()) else float("nan")
    per_token = correct.sum().item() / n_tok if n_tok else float("nan")
    return {"per_example": per_example, "per_token": per_token,
            "num_examples": int(has.sum()), "num_tokens": n_tok}


def accuracy_by_group(predictions: torch.Tensor, labels: torch.Tensor,
                      groups: Sequence[Hashable] | torch.Tensor) -> Dict[Hashable, Dict[str, float]]:
    """``accuracy`` computed separately for each distinct group label (one per example)."""
    keys = groups.tolist() if isinstance(groups, torch.Tensor) else list(groups)
    if len(keys) != predictions.shape[0]:
        raise ValueError(f"{len(keys)} group labels for {predictions.shape[0]} examples")
    out: Dict[Hashable, Dict[str, float]] = {}
    for k in sorted(set(keys), key=repr):
        rows = torch.tensor([i for i, kk in enumerate(keys) if kk == k], dtype=torch.long)
        out[k] = accuracy(predictions[rows], labels[rows])
    return out


def accuracy_per_n(predictions: torch.Tensor, labels: torch.Tensor,
                   setting_index: torch.Tensor, settings: Sequence[MQARSetting]
                   ) -> Dict[int, Dict[str, float]]:
    """Per-N accuracy for a mixed set: examples grouped by the num_kv_pairs of
    ``settings[setting_index[i]]`` (settings sharing N are pooled)."""
    ns = [settings[i].num_kv_pairs for i in setting_index.tolist()]
    return accuracy_by_group(predictions, labels, ns)  # type: ignore[return-value]


__all__ = [
    "IGNORE_INDEX", "DEFAULT_TEST_SEED", "MQARSetting", "make_mqar", "make_splits",
    "gap_probabilities", "derived_train_seed", "derived_test_seed", "accuracy", "accuracy_by_group",
    "accuracy_per_n",
]
