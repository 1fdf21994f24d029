"""Probe-suite generators (harness/probe/): each held to its documented definition, answers recomputed naively."""
import dataclasses
import itertools
import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from harness.probe import (
    BASELINES,
    CHANGES,
    IGNORE_INDEX,
    CompressionSetting,
    FuzzyRecallSetting,
    MemorizationSetting,
    ParitySetting,
    RecallSetting,
    SelectiveCopySetting,
    WordProblemSetting,
    make_examples,
    memorization_map,
    variants,
)

set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "archzoo-hypothesis")
PROPERTY = settings(deadline=None, database=None, derandomize=True, max_examples=60)
SPLIT = st.sampled_from(["train", "test"])
SEED = st.integers(0, 2 ** 40)


def _valid(setting) -> bool:
    try:
        setting.validate()
    except ValueError:
        return False
    return True


# ---- in-context recall (exact and noisy) ----

RECALL = st.builds(RecallSetting, vocab_size=st.integers(4, 40), seq_len=st.integers(2, 32).map(lambda h: 2 * h),
                   multi_query=st.booleans(), noise_vocab_size=st.integers(0, 5),
                   frac_noise=st.sampled_from([0.0, 0.3, 0.7]))


def _presented_before(xs, key, slot, K):
    """Naively: does `key` occur as a real key in a slot before `slot`?"""
    return any(xs[2 * j] == key for j in range(slot) if xs[2 * j] < K)


def _check_recall(s: RecallSetting, x, y, split):
    n = x.shape[0]
    assert x.shape == y.shape == (n, s.width) and x.dtype == y.dtype == torch.long
    assert x.min() >= 0 and x.max() < s.vocab_size
    K, kv, C = s.num_keys, s.kv_vocab, s.num_slots
    for xs, ys in zip(x.tolist(), y.tolist()):
        seen, expected = {}, []
        for slot in range(C):
            a, b = xs[2 * slot], xs[2 * slot + 1]
            if a < K:  # a key (from the lower half) followed by its value (from the upper half)
                assert K <= b < kv
                assert seen.setdefault(a, b) == b, "a key stands for one value within an example"
                expected += [b if s.multi_query and _presented_before(xs, a, slot, K) else IGNORE_INDEX, IGNORE_INDEX]
            else:  # a noise slot: both tokens from the noise ids
                assert kv <= a < kv + s.noise_vocab_size and kv <= b < kv + s.noise_vocab_size
                expected += [IGNORE_INDEX, IGNORE_INDEX]
        assert seen, "at least one real pair"
        tail = xs[2 * C:]
        if not s.multi_query:
            assert tail[0] == s.marker == s.vocab_size - 1
            expected.append(IGNORE_INDEX)
        query = tail[-1]
        assert query in seen, "the query key was presented in the context"
        expected.append(seen[query])
        if split == "test":
            assert ys == expected
        else:
            assert ys[:-1] == xs[1:] and ys[-1] == seen[query]


@settings(PROPERTY)
@given(s=RECALL, seed=SEED, split=SPLIT)
def test_recall_matches_definition(s, seed, split):
    assume(_valid(s))
    x, y = make_examples(s, 20, seed, split=split)
    _check_recall(s, x, y, split)


def test_recall_baseline_and_splits_share_inputs():
    s = BASELINES["in-context-recall"]
    xtr, ytr = make_examples(s, 50, 3, split="train")
    xte, yte = make_examples(s, 50, 3, split="test")
    assert xtr.shape == (50, 127)  # multi-query: seq_len - 1, as in MAD-Lab
    assert torch.equal(xtr, xte) and torch.equal(ytr[:, -1], yte[:, -1])
    _check_recall(s, xtr, ytr, "train")
    _check_recall(s, xte, yte, "test")
    # keys 0..7, values 8..15: disjoint halves of the 16 ids
    assert s.num_keys == 8 and s.kv_vocab == 16
    # multi-query probes many repeated keys per example, not just the last
    assert ((yte != IGNORE_INDEX).sum(1) > 10).all()


def test_single_query_labels_only_the_query():
    s = RecallSetting(vocab_size=16, seq_len=64, multi_query=False)
    x, y = make_examples(s, 50, 0, split="test")
    assert x.shape == (50, 64)
    assert ((y != IGNORE_INDEX).sum(1) == 1).all() and (y[:, -1] != IGNORE_INDEX).all()
    assert (x[:, -2] == 15).all() and (x[:, :-2] < 15).all()


def test_noise_rate_near_setting():
    s = RecallSetting(vocab_size=32, seq_len=64, noise_vocab_size=16, frac_noise=0.3)
    x, _ = make_examples(s, 2000, 5, split="test")
    slots = x[:, 0:2 * s.num_slots:2]
    noisy = (slots >= s.kv_vocab).float().mean().item()
    # one slot per example is kept real, so the expected rate is frac * (C - 1) / C
    expected = 0.3 * (s.num_slots - 1) / s.num_slots
    assert noisy == pytest.approx(expected, abs=0.01)
    noise = x[x >= s.kv_vocab]
    assert noise.min() >= 16 and noise.max() <= 31
    # noise ids are used roughly evenly
    assert torch.bincount(noise - 16, minlength=16).min() > 0.8 * noise.numel() / 16


# ---- fuzzy in-context recall ----

FUZZY = st.builds(FuzzyRecallSetting, vocab_size=st.integers(8, 24), seq_len=st.integers(13, 80),
                  max_key_span=st.integers(1, 3), max_value_span=st.integers(1, 3), multi_query=st.booleans())


def _runs(tokens, K, kv):
    """Split into maximal runs of key tokens and of value tokens: [(is_key, start, [tokens])]."""
    out = []
    for p, t in enumerate(tokens):
        kind = t < K
        assert t < kv, f"token {t} at {p} is not a key or value"
        if out and out[-1][0] == kind:
            out[-1][2].append(t)
        else:
            out.append((kind, p, [t]))
    return out


def _check_fuzzy(s: FuzzyRecallSetting, x, y, split):
    n = x.shape[0]
    assert x.shape == y.shape == (n, s.seq_len)
    assert x.min() >= 0 and x.max() < s.vocab_size
    K, kv = s.num_key_tokens, s.kv_vocab
    span_lengths = set()
    full = torch.cat([x, y[:, -1:]], dim=1)  # the last token is a query value token, labelled in both splits
    for fs, ys in zip(full.tolist(), y.tolist()):
        pad = 0
        while fs[pad] == s.pad:
            pad += 1
        body = fs[pad:]
        if s.multi_query:
            runs = _runs(body, K, kv)
        else:  # the marker sits between the context and the query; run starts stay indices into body
            m = body.index(s.marker)
            assert body.count(s.marker) == 1
            runs = _runs(body[:m], K, kv) + [(k, m + 1 + p, r) for k, p, r in _runs(body[m + 1:], K, kv)]
        assert [r[0] for r in runs] == [True, False] * (len(runs) // 2) and len(runs) >= 4
        items = [(runs[i], runs[i + 1]) for i in range(0, len(runs), 2)]
        expected = [IGNORE_INDEX] * len(fs)
        seen = {}
        for i, ((_, _, key), (_, vstart, value)) in enumerate(items):
            last = i == len(items) - 1
            assert len(set(key)) == len(key) <= s.max_key_span and len(set(value)) == len(value) <= s.max_value_span
            if split == "test":
                assert len(key) == s.max_key_span
            span_lengths.add((len(key), len(value)))
            repeat = tuple(key) in seen
            if last:
                assert repeat, "the query key appeared in the context"
            assert seen.setdefault(tuple(key), value) == value, "a key span carries one value span"
            if last or (repeat and s.multi_query):
                for j, t in enumerate(value):
                    expected[pad + vstart + j] = t
        if split == "test":
            assert ys == expected[1:]
        else:
            assert ys == fs[1:]
    return span_lengths


@settings(PROPERTY)
@given(s=FUZZY, seed=SEED, split=SPLIT)
def test_fuzzy_recall_matches_definition(s, seed, split):
    assume(_valid(s))
    x, y = make_examples(s, 10, seed, split=split)
    _check_fuzzy(s, x, y, split)


def test_fuzzy_baseline():
    s = BASELINES["fuzzy-in-context-recall"]
    spans = {split: _check_fuzzy(s, *make_examples(s, 40, 1, split=split), split) for split in ("train", "test")}
    # train: every key and value span length 1..3 occurs; test: keys at 3 only, values still 1..3
    assert spans["train"] == set(itertools.product((1, 2, 3), repeat=2))
    assert spans["test"] == set(itertools.product((3,), (1, 2, 3)))
    # the context fills its budget, so the left padding is short: at most 2 * max_item - 3 tokens
    x, _ = make_examples(s, 200, 2, split="train")
    pads = (x == s.pad).sum(1)
    assert pads.max() <= 2 * s.max_item - 3 and pads.unique().numel() > 3


# ---- selective copying, compression ----

COPY = st.builds(SelectiveCopySetting, vocab_size=st.integers(3, 20), seq_len=st.integers(4, 80),
                 num_tokens_to_copy=st.integers(1, 12))


def _check_selective_copy(s: SelectiveCopySetting, x, y):
    N = s.num_tokens_to_copy
    assert x.shape == y.shape == (x.shape[0], s.seq_len)
    for xs, ys in zip(x.tolist(), y.tolist()):
        d = xs.index(s.delimiter)
        assert d == s.seq_len - N - 1 and xs.count(s.delimiter) == 1
        content = [t for t in xs[:d] if t != s.blank]
        assert len(content) == N and all(t < s.vocab_size - 2 for t in content)
        assert xs[d - 1] != s.blank, "the last content token directly precedes the delimiter"
        assert xs[d + 1:] == [s.blank] * N
        assert ys == [IGNORE_INDEX] * (d + 1) + content


@settings(PROPERTY)
@given(s=COPY, seed=SEED, split=SPLIT)
def test_selective_copy_matches_definition(s, seed, split):
    assume(_valid(s))
    x, y = make_examples(s, 20, seed, split=split)
    _check_selective_copy(s, x, y)


def test_selective_copy_baseline_spreads_tokens():
    s = BASELINES["selective-copying"]
    x, y = make_examples(s, 300, 0, split="train")
    _check_selective_copy(s, x, y)
    first = (x[:, :s.seq_len - 17] != s.blank).long().argmax(1)
    # blanks land in front of the first token too (MAD-Lab inserts before any content token)
    assert first.float().mean() > 3 and first.max() > 20


@settings(PROPERTY)
@given(vocab=st.integers(2, 40), seq_len=st.integers(2, 40), seed=SEED, split=SPLIT)
def test_compression_matches_definition(vocab, seq_len, seed, split):
    s = CompressionSetting(vocab, seq_len)
    x, y = make_examples(s, 20, seed, split=split)
    m = seq_len - 1
    assert x.shape == y.shape == (20, 2 * m)
    assert (x[:, :m] < vocab - 1).all() and (x[:, :m] >= 0).all()
    assert (x[:, m:] == vocab - 1).all()
    assert (y[:, :m] == IGNORE_INDEX).all() and torch.equal(y[:, m:], x[:, :m])


# ---- memorization ----

def test_memorization_map_fixed_and_labels_follow_it():
    s = MemorizationSetting(num_keys=64, seq_len=16)
    facts = {}
    for seed in (0, 1, 2):
        for split in ("train", "test"):
            x, y = make_examples(s, 200, seed, split=split)
            assert x.shape == y.shape == (200, 16)
            assert (x[:, 1::2] == s.insert_token).all() and (x[:, 0::2] < 64).all()
            assert (y[:, 0::2] == IGNORE_INDEX).all()
            for k, v in zip(x[:, 0::2].flatten().tolist(), y[:, 1::2].flatten().tolist()):
                assert facts.setdefault(k, v) == v, "same fact in every seed and split"
    assert len(facts) == 64
    # a one-to-one map onto the value ids, equal to the published map whatever seed drew the examples
    mapping = memorization_map(s).tolist()
    assert sorted(mapping) == list(range(64, 128))
    assert all(mapping[k] == v for k, v in facts.items())
    torch.manual_seed(123)
    assert memorization_map(s).tolist() == mapping
    assert memorization_map(dataclasses.replace(s, map_seed=7)).tolist() != mapping
    base = BASELINES["memorization"]
    assert base.num_keys == 256 and base.vocab_size == 513


# ---- parity and word problems ----

@settings(PROPERTY)
@given(lo=st.integers(1, 30), extra=st.integers(0, 30), seed=SEED, split=SPLIT)
def test_parity_matches_definition(lo, extra, seed, split):
    s = ParitySetting(lo, lo + extra)
    x, y = make_examples(s, 30, seed, split=split)
    assert x.shape == y.shape == (30, s.max_len)
    for xs, ys in zip(x.tolist(), y.tolist()):
        length = len(xs) - xs.count(2)
        assert lo <= length <= s.max_len and xs[length:] == [2] * (len(xs) - length)
        assert set(xs[:length]) <= {0, 1}
        running = [sum(xs[:t + 1]) % 2 for t in range(length)]
        if split == "train":
            assert ys == running + [IGNORE_INDEX] * (len(xs) - length)
        else:
            assert ys == [IGNORE_INDEX] * (length - 1) + [running[-1]] + [IGNORE_INDEX] * (len(xs) - length)


def test_parity_named_lengths():
    for name, lo, hi in (("parity", 3, 40), ("parity-long", 40, 256)):
        s = BASELINES[name]
        x, _ = make_examples(s, 400, 0, split="test")
        lengths = (x != 2).sum(1)
        assert (s.min_len, s.max_len) == (lo, hi)
        assert lengths.min() >= lo and lengths.max() <= hi and lengths.unique().numel() > (hi - lo) // 2


def _naive_group(name):
    def even(p):  # sign by cycle decomposition: a permutation is even iff it has an even number of even cycles
        seen, even_cycles = set(), 0
        for i in range(5):
            size = 0
            while i not in seen:
                seen.add(i)
                i = p[i]
                size += 1
            even_cycles += size > 0 and size % 2 == 0
        return even_cycles % 2 == 0
    perms = list(itertools.permutations(range(5)))
    return perms if name == "S5" else [p for p in perms if even(p)]


@pytest.mark.parametrize("group,order", [("S5", 120), ("A5", 60)])
@pytest.mark.parametrize("split", ["train", "test"])
def test_word_problem_prefix_products(group, order, split):
    s = WordProblemSetting(group, 2, 20)
    perms = _naive_group(group)
    assert len(perms) == order == s.order
    ids = {p: i for i, p in enumerate(perms)}
    x, y = make_examples(s, 100, 4, split=split)
    assert x.shape == y.shape == (100, 20)
    lengths = set()
    for xs, ys in zip(x.tolist(), y.tolist()):
        length = len(xs) - xs.count(order)
        lengths.add(length)
        assert 2 <= length <= 20 and xs[length:] == [order] * (20 - length)
        state = tuple(range(5))
        for t in range(length):
            g = perms[xs[t]]
            state = tuple(g[state[i]] for i in range(5))  # apply the prefix so far, then g
            assert ys[t] == ids[state]
        assert ys[length:] == [IGNORE_INDEX] * (20 - length)
    assert min(lengths) <= 4 and max(lengths) >= 18
    assert len(set(x[x < order].tolist())) > order * 0.9


# ---- across tasks ----

SMALL = {
    "in-context-recall": RecallSetting(16, 32),
    "fuzzy-in-context-recall": FuzzyRecallSetting(16, 32),
    "noisy-in-context-recall": RecallSetting(32, 32, noise_vocab_size=16, frac_noise=0.2),
    "selective-copying": SelectiveCopySetting(16, 64, 8),
    "compression": CompressionSetting(16, 16),
    "memorization": MemorizationSetting(32, 16),
    "parity": ParitySetting(3, 20),
    "s5": WordProblemSetting("S5", 2, 10),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_deterministic_and_seed_sensitive(name):
    s = SMALL[name]
    a = make_examples(s, 40, 7, split="test")
    torch.manual_seed(0)  # no global RNG involved
    b = make_examples(s, 40, 7, split="test")
    c = make_examples(s, 40, 8, split="test")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert make_examples(s, 0, 7, split="train")[0].shape == (0, s.width)


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_baselines_valid_and_every_row_scored(name):
    s = BASELINES[name].validate()
    for split in ("train", "test"):
        x, y = make_examples(s, 4, 0, split=split)
        assert x.shape == y.shape == (4, s.width)
        assert ((y != IGNORE_INDEX).sum(1) > 0).all()


def test_variants_follow_mad_changes():
    for task, changes in CHANGES.items():
        vs = variants(task)
        assert vs[0].change == "baseline" and vs[0].setting == BASELINES[task]
        assert len(vs) == 1 + sum(len(v) for v in changes.values())
        for v in vs[1:]:
            field, value = v.change.split("=")
            if field == "num_train_examples":
                assert v.setting == BASELINES[task] and v.num_train_examples == int(value)
            else:
                assert str(getattr(v.setting, field)) == value
                assert dataclasses.replace(v.setting, **{field: getattr(BASELINES[task], field)}) == BASELINES[task]
    assert variants("memorization")[0].num_train_examples == 256
    assert variants("compression")[0].num_train_examples == 12_800
    with pytest.raises(ValueError, match="parity"):
        variants("parity")


BAD = [
    (RecallSetting(seq_len=7), "seq_len=7"),
    (RecallSetting(seq_len=2), "seq_len=2"),
    (RecallSetting(seq_len=True), "seq_len=True"),
    (RecallSetting(vocab_size=3, noise_vocab_size=2), "vocab_size=3"),
    (RecallSetting(vocab_size=32, noise_vocab_size=16, frac_noise=1.0), "frac_noise=1.0"),
    (RecallSetting(vocab_size=32, noise_vocab_size=16, frac_noise=-0.1), "frac_noise=-0.1"),
    (RecallSetting(frac_noise=0.2), "frac_noise=0.2"),
    (RecallSetting(noise_vocab_size=-1), "noise_vocab_size=-1"),
    (FuzzyRecallSetting(vocab_size=6), "vocab_size=6"),
    (FuzzyRecallSetting(seq_len=8), "seq_len=8"),
    (FuzzyRecallSetting(max_key_span=0), "max_key_span=0"),
    (SelectiveCopySetting(seq_len=33, num_tokens_to_copy=16), "seq_len=33"),
    (SelectiveCopySetting(vocab_size=2), "vocab_size=2"),
    (CompressionSetting(seq_len=0), "seq_len=0"),
    (MemorizationSetting(num_keys=0), "num_keys=0"),
    (MemorizationSetting(seq_len=31), "seq_len=31"),
    (ParitySetting(min_len=41, max_len=40), "min_len=41"),
    (ParitySetting(min_len=0), "min_len=0"),
    (WordProblemSetting("S4"), "group='S4'"),
    (WordProblemSetting(max_len=0), "max_len=0"),
]


@pytest.mark.parametrize("setting,fragment", BAD, ids=[f for _, f in BAD])
def test_bad_settings_raise_before_allocating(setting, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        setting.validate()
    # refused before any tensor is made: a huge request fails fast with the setting's error, not MemoryError
    with pytest.raises(ValueError, match=re.escape(fragment)):
        make_examples(setting, 10 ** 15, 0, split="train")


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(num_examples=-1, seed=0, split="train"), "num_examples=-1"),
    (dict(num_examples=2.5, seed=0, split="train"), "num_examples=2.5"),
    (dict(num_examples=4, seed=0, split="dev"), "split='dev'"),
])
def test_bad_requests_raise(kwargs, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        make_examples(SMALL["parity"], **kwargs)
    with pytest.raises(ValueError, match="not a probe setting"):
        make_examples(object(), 4, 0, split="train")
