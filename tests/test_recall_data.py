"""MQAR generator (harness/recall/data.py): Zoology semantics, determinism, splits, metrics."""
import pytest
import torch

from harness.recall import (
    IGNORE_INDEX,
    MQARSetting,
    accuracy,
    accuracy_per_n,
    make_mqar,
    make_splits,
    derived_test_seed,
    derived_train_seed,
)


def _structure(setting, inputs, labels):
    """Check one batch against the MQAR layout; returns query positions [n, N]."""
    L, N, V = setting.seq_len, setting.num_kv_pairs, setting.vocab_size
    n = inputs.shape[0]
    assert inputs.shape == labels.shape == (n, L)
    assert inputs.dtype == labels.dtype == torch.long
    keys, values = inputs[:, 0:2 * N:2], inputs[:, 1:2 * N:2]
    assert ((keys >= 1) & (keys < V // 2)).all()
    assert ((values >= V // 2) & (values < V)).all()
    for row in range(n):
        assert len(set(keys[row].tolist())) == N
        assert len(set(values[row].tolist())) == N
    # labels: nothing in the KV block, exactly N labels, all at even offsets after it
    assert (labels[:, :2 * N] == IGNORE_INDEX).all()
    lab = labels != IGNORE_INDEX
    assert (lab.sum(1) == N).all()
    pos = lab.nonzero()[:, 1].view(n, N)
    assert ((pos - 2 * N) % 2 == 0).all()
    q_tok = inputs.gather(1, pos)
    q_lab = labels.gather(1, pos)
    for row in range(n):
        pairs = dict(zip(keys[row].tolist(), values[row].tolist()))
        # every key queried exactly once, label = its paired value
        assert sorted(q_tok[row].tolist()) == sorted(pairs)
        assert [pairs[k] for k in q_tok[row].tolist()] == q_lab[row].tolist()
    return pos


@pytest.mark.parametrize("L,N", [(64, 4), (128, 8), (256, 16), (512, 64), (16, 4)])
def test_layout_zero_filler(L, N):
    s = MQARSetting(L, N, random_non_queries=False)
    x, y = make_mqar(s, 200, seed=0)
    pos = _structure(s, x, y)
    # everything outside the KV block and the query keys is 0
    filler = torch.ones_like(x, dtype=torch.bool)
    filler[:, :2 * N] = False
    filler.scatter_(1, pos, False)
    assert (x[filler] == 0).all()
    # the value never follows its query in the input (the next token is filler)
    nxt = x.gather(1, pos + 1)
    assert (nxt == 0).all()
    assert (nxt != y.gather(1, pos)).all()


def test_zoology_docstring_example_shape():
    # Zoology's example: V=12, N=2, L=16 -> keys in 1..5, values in 6..11.
    s = MQARSetting(16, 2, vocab_size=17, random_non_queries=False)
    x, y = make_mqar(s, 50, seed=3)
    _structure(s, x, y)


def test_random_filler():
    s = MQARSetting(256, 16)
    z = MQARSetting(256, 16, random_non_queries=False)
    x, y = make_mqar(s, 500, seed=1)
    x0, y0 = make_mqar(z, 500, seed=1)
    pos = _structure(s, x, y)
    # same KV block, queries and labels as the zero-filler twin: only zeros replaced
    assert torch.equal(y, y0)
    nonzero = x0 != 0
    assert torch.equal(x[nonzero], x0[nonzero])
    # filler drawn uniformly from 0..V-1 (Zoology: randint(vocab_size)), so it spans
    # both halves of the vocab and is rarely 0
    f = x[~nonzero]
    assert f.min() >= 0 and f.max() < s.vocab_size
    assert (f < s.vocab_size // 2).float().mean().item() == pytest.approx(0.5, abs=0.02)
    assert (f == 0).float().mean().item() < 0.01
    # token after a query is random filler: equals the answer only by chance (~1/V)
    hits = (x.gather(1, pos + 1) == y.gather(1, pos)).sum().item()
    assert hits <= 5


def test_deterministic_and_seed_sensitive():
    s = MQARSetting(128, 8)
    a = make_mqar(s, 300, seed=7)
    b = make_mqar(s, 300, seed=7)
    c = make_mqar(s, 300, seed=8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    # no global RNG involved
    torch.manual_seed(0)
    d = make_mqar(s, 300, seed=7)
    assert torch.equal(a[0], d[0])


def test_gap_distribution_clusters_after_kv_block():
    s = MQARSetting(256, 16, random_non_queries=False)
    _, y = make_mqar(s, 4000, seed=0)
    slot = ((y != IGNORE_INDEX).nonzero()[:, 1] - 2 * s.num_kv_pairs) // 2
    counts = torch.bincount(slot, minlength=s.num_slots).float()
    assert counts.sum().item() == 4000 * 16
    # with a = 0.01, slot 0 has p ≈ 100x slot 1; it is used in (nearly) every example
    assert counts[0] > 0.95 * 4000
    assert counts[0] > 20 * counts[-1]
    assert counts[: s.num_slots // 4].sum() > counts[-(s.num_slots // 4):].sum()
    # a = 1 is uniform: no such clustering
    u = MQARSetting(256, 16, power_a=1.0, random_non_queries=False)
    _, yu = make_mqar(u, 4000, seed=0)
    su = ((yu != IGNORE_INDEX).nonzero()[:, 1] - 32) // 2
    cu = torch.bincount(su, minlength=u.num_slots).float()
    assert cu[0] < 2 * cu.mean()


@pytest.mark.parametrize("kw,match", [
    (dict(seq_len=64, num_kv_pairs=17), "too large"),
    (dict(seq_len=63, num_kv_pairs=4), "even"),
    (dict(seq_len=64, num_kv_pairs=4, vocab_size=64), "vocab_size"),
    (dict(seq_len=64, num_kv_pairs=0), "num_kv_pairs"),
    (dict(seq_len=64, num_kv_pairs=4, power_a=0.0), "power_a"),
])
def test_bad_settings_raise(kw, match):
    s = MQARSetting(**kw)
    with pytest.raises(ValueError, match=match):
        s.validate()
    with pytest.raises(ValueError, match=match):
        make_mqar(s, 4, seed=0)


def test_boundary_settings_ok():
    MQARSetting(64, 16).validate()                   # 4N == L
    MQARSetting(64, 4, vocab_size=65).validate()     # V == L + 1


def test_splits_disjoint_and_test_fixed():
    s64, s128 = MQARSetting(64, 4), MQARSetting(128, 8)
    (xi, yi, si), test = make_splits([(s64, 1000), (s128, 1000)],
                                     [(s64, 300), (s128, 300)], seed=0)
    assert xi.shape == (2000, 128) and si.shape == (2000,)
    assert (si == 0).sum() == 1000 and (si == 1).sum() == 1000
    assert not torch.equal(si[:1000], torch.zeros(1000, dtype=torch.long))  # shuffled
    # shorter setting padded with 0 / -100
    assert (xi[si == 0, 64:] == 0).all() and (yi[si == 0, 64:] == IGNORE_INDEX).all()
    _structure(s64, xi[si == 0, :64], yi[si == 0, :64])
    _structure(s128, xi[si == 1], yi[si == 1])
    # no test example appears in train
    for k, (s, (tx, ty)) in enumerate(zip([s64, s128], test)):
        _structure(s, tx, ty)
        train_rows = {tuple(r) for r in xi[si == k, :s.seq_len].tolist()}
        assert not train_rows & {tuple(r) for r in tx.tolist()}
    # seeds: train even / test odd -> never equal
    for k, s in enumerate([s64, s128]):
        assert derived_train_seed(s, k, 0) % 2 == 0 and derived_test_seed(s) % 2 == 1
    # test set depends only on the setting: other settings / run seed don't matter
    (_, _, _), test2 = make_splits([(s128, 10)], [(s128, 300)], seed=99)
    assert torch.equal(test2[0][0], test[1][0]) and torch.equal(test2[0][1], test[1][1])
    # train reproducible by seed, different across seeds
    (xj, _, sj), _ = make_splits([(s64, 1000), (s128, 1000)], [], seed=0)
    (xk, _, _), _ = make_splits([(s64, 1000), (s128, 1000)], [], seed=1)
    assert torch.equal(xi, xj) and torch.equal(si, sj)
    assert not torch.equal(xi, xk)


def test_accuracy_and_per_n():
    s4, s8 = MQARSetting(64, 4), MQARSetting(64, 8)
    x4, y4 = make_mqar(s4, 10, seed=0)
    x8, y8 = make_mqar(s8, 10, seed=0)
    y = torch.cat([y4, y8])
    pred = torch.where(y == IGNORE_INDEX, torch.zeros_like(y), y)
    assert accuracy(pred, y)["per_example"] == 1.0
    assert accuracy(pred, y)["per_token"] == 1.0
    # break: all N=8 rows wrong on one position, N=4 rows untouched
    lab = (y8 != IGNORE_INDEX).nonzero()
    first = lab[torch.cat([torch.tensor([True]), lab[1:, 0] != lab[:-1, 0]])]
    pred[10 + first[:, 0], first[:, 1]] += 1
    acc = accuracy(pred, y)
    assert acc["per_token"] == pytest.approx(1 - 10 / 120)
    assert acc["per_example"] == pytest.approx((10 * 1.0 + 10 * 7 / 8) / 20)
    idx = torch.tensor([0] * 10 + [1] * 10)
    by_n = accuracy_per_n(pred, y, idx, [s4, s8])
    assert by_n[4]["per_example"] == 1.0
    assert by_n[8]["per_example"] == pytest.approx(7 / 8)
    assert by_n[8]["num_examples"] == 10


def test_speed_10k_L256():
    import time
    s = MQARSetting(256, 16)
    make_mqar(s, 100, seed=0)
    t = time.perf_counter()
    make_mqar(s, 10_000, seed=0)
    assert time.perf_counter() - t < 3.0  # ~0.1 s single-threaded; slack for busy CI
