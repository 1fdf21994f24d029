"""The MoE auxiliary losses (zoo/ffn/routing_losses.py, harness/train/moe_losses.py): the Switch Transformer balance
loss and ST-MoE's router z-loss equal hand computations and reach the router; `zoo train` and `zoo recall` train on
them and report routing statistics in range; the balance loss evens out a skewed router; bad weights fail before
work; a model without MoE layers ignores the weights and records them as not applying; inference keeps nothing."""
import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

import zoo
from harness import cli
from harness.recall import MQARSetting, make_mqar
from harness.recall.suite import RecallSettings
from harness.recall.train import TrainConfig, point_accuracy, train_recall
from harness.train import TrainSettings, objective, run_train, trainer
from harness.train.corpus import training_batch
from harness.train.moe_losses import MoETraining, take_routing
from test_cli_checks import RECALL, fail_if_called  # tests/ is on sys.path under pytest
from test_train import TINY, copy_corpus
from zoo.ffn.moe import MoE
from zoo.ffn.routing_losses import Routing, balance_loss, entropy_nats, load_max_over_mean, z_loss

TRAIN = ["train", "--context", "32", "--batch-size", "4", "--max-steps", "2", "--eval-windows", "4", "--quiet"]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return copy_corpus(tmp_path_factory.mktemp("corpus"))


def known_routing(probabilities, ids, scoring="softmax") -> Routing:
    """A routing whose router distribution is `probabilities` (logits = their logs, which softmax maps back)."""
    return Routing(torch.tensor(probabilities, dtype=torch.float64).log(), torch.tensor(ids), scoring)


# ---- the losses, by hand -------------------------------------------------------------------------------------------

def test_balance_loss_of_an_enumerated_top1_routing():
    """4 tokens, 4 experts, top 1 to experts 0, 0, 1, 2: f = (1/2, 1/4, 1/4, 0); P = the probabilities' column means
    (0.325, 0.25, 0.3, 0.125); 4 * (0.5 * 0.325 + 0.25 * 0.25 + 0.25 * 0.3 + 0) = 1.2."""
    routing = known_routing([[0.7, 0.1, 0.1, 0.1], [0.4, 0.2, 0.2, 0.2], [0.1, 0.6, 0.2, 0.1],
                             [0.1, 0.1, 0.7, 0.1]], [[0], [0], [1], [2]])
    assert float(balance_loss(routing)) == pytest.approx(1.2, abs=1e-12)
    assert load_max_over_mean(routing) == 2.0  # counts (2, 1, 1, 0) over their mean 1


@pytest.mark.parametrize("top_k", [1, 2])
def test_uniform_routing_gives_exactly_one(top_k):
    """Each expert chosen equally often: f_i = 1/E, so E * sum_i f_i P_i = sum_i P_i = 1 whatever the probabilities."""
    logits = torch.randn(4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])[:, :top_k]
    routing = Routing(logits, ids, "softmax")
    assert float(balance_loss(routing)) == pytest.approx(1.0, abs=1e-12)
    assert load_max_over_mean(routing) == 1.0
    uniform = Routing(torch.zeros(4, 4), ids, "softmax")
    assert entropy_nats(uniform) == pytest.approx(math.log(4), abs=1e-6)


def test_the_sigmoid_routers_distribution_is_its_normalised_scores():
    """DeepSeek-V3's s'_i = s_i / sum_j s_j: logits 0 and ln 3 give scores 1/2 and 3/4, so s' = (2/5, 3/5)."""
    routing = Routing(torch.tensor([[0.0, math.log(3)]] * 2, dtype=torch.float64), torch.tensor([[1], [0]]), "sigmoid")
    assert routing.probabilities()[0].tolist() == pytest.approx([0.4, 0.6], abs=1e-12)
    assert float(balance_loss(routing)) == pytest.approx(2 * (0.5 * 0.4 + 0.5 * 0.6), abs=1e-12)
    want = -(0.4 * math.log(0.4) + 0.6 * math.log(0.6))
    assert entropy_nats(routing) == pytest.approx(want, abs=1e-6)


def test_z_loss_is_the_mean_squared_logsumexp():
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(1)) * 3
    want = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 5
    assert float(z_loss(Routing(logits, logits.argmax(-1, keepdim=True), "softmax"))) == pytest.approx(want, rel=1e-5)


def test_the_balance_loss_of_a_layers_own_routing_equals_a_dense_computation():
    """Through MoE.route in training mode: f from one-hot counts of the ids, P from a float64 softmax."""
    torch.manual_seed(0)
    moe = MoE(16, 8, n_experts=6, top_k=2).train()
    with torch.no_grad():
        moe.gate.weight.normal_()
    moe(torch.randn(2, 9, 16))
    routing = moe.last_routing
    ids = routing.ids
    assert ids.shape == (18, 2)
    counts = torch.nn.functional.one_hot(ids.flatten(), 6).double().sum(0)
    p = torch.softmax(routing.logits.double(), -1).mean(0)
    want = 6 * float((counts / ids.numel() * p).sum().detach())
    assert float(balance_loss(routing).detach()) == pytest.approx(want, rel=1e-6)
    assert 1.0 <= load_max_over_mean(routing) <= 6 / 2


# ---- gradients, and what inference keeps --------------------------------------------------------------------------

@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("loss", [balance_loss, z_loss])
def test_the_auxiliary_losses_reach_the_router_and_only_it(router, loss):
    torch.manual_seed(0)
    moe = MoE(16, 8, n_experts=4, top_k=2, router=router).train()
    moe(torch.randn(10, 16))
    loss(moe.last_routing).backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in moe.experts.parameters())  # the experts' weights do not route


def test_routing_is_kept_only_in_training_and_taken_once():
    model = zoo.build("moe", preset="tiny", n_layers=2)
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        model.eval()(tokens)
    assert all(moe.last_routing is None for moe in zoo.moe_layers(model).values())  # eval, decode, compile: nothing
    model.train()(tokens)
    taken = take_routing(model)
    assert sorted(taken) == [0, 1] and all(r.ids.shape == (24, 2) for r in taken.values())
    assert all(moe.last_routing is None for moe in zoo.moe_layers(model).values())
    with pytest.raises(RuntimeError, match="kept no routing: the step's forward must run in training mode"):
        take_routing(model)
    model(tokens)
    assert copy.deepcopy(model).blocks[0].mlp.last_routing.logits.grad_fn is None  # zoo.quantize copies a model


# ---- zoo train ---------------------------------------------------------------------------------------------------

def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def assert_routing_in_range(routing: dict, n_experts: int, layers: list[str]) -> None:
    assert sorted(routing["layers"]) == layers
    for stats in [routing, *routing["layers"].values()]:
        assert all(math.isfinite(v) for k, v in stats.items() if k != "layers")
        assert 1.0 <= stats["load_max_over_mean"] <= n_experts  # top_k >= 1: at most n_experts / top_k
        assert -1e-6 <= stats["entropy_nats"] <= math.log(n_experts) + 1e-6
        assert stats["balance_loss"] > 0
        assert stats["z_loss"] >= 0


def test_zoo_train_reports_routing_per_layer_and_averaged(tmp_path, corpus_dir, capsys):
    argv = TRAIN + ["--arch", "moe", "--set", "n_experts=4", "--set", "top_k=1", "--eval-every", "1",
                    "--moe-balance-weight", "0.1", "--moe-z-weight", "0.01", "--minutes", "none",
                    "--corpus", str(corpus_dir), "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    written = rows(tmp_path)
    assert [row["step"] for row in written] == [1, 2]
    for row in written:
        assert (row["moe_balance_weight"], row["moe_z_weight"]) == (0.1, 0.01)
        assert_routing_in_range(row["moe_routing"], 4, ["0", "1"])
        layers = row["moe_routing"]["layers"].values()
        assert row["moe_routing"]["entropy_nats"] == pytest.approx(sum(l["entropy_nats"] for l in layers) / 2)
    assert "load max/mean" in capsys.readouterr().out
    assert zoo.load(tmp_path / "checkpoint").config.ffn(0).kind == "moe"


def test_the_reported_training_loss_is_the_task_loss_alone(tmp_path, corpus_dir):
    """A large z weight changes the step's total loss, not the loss train_step returns (bits per byte stay the
    task's)."""
    settings = TrainSettings(**{**TINY, "arch": "moe", "corpus": corpus_dir, "out": tmp_path, "max_steps": 1,
                                "moe_z_weight": 10.0})
    run = trainer.start_run(settings)
    batch = training_batch(run.corpus, settings.seed, 0, settings.batch_size, settings.context + 1)
    with torch.no_grad():
        task = float(objective.loss(run.model, batch))
    aux = float(run.moe.step_loss(run.model))  # the same forward's auxiliary losses, taken so the step starts clean
    assert aux > 0.01 * task
    assert trainer.train_step(run, 1e-3, use_autocast=False) == pytest.approx(task, rel=1e-5)
    assert run.moe.report()["moe_routing"]["z_loss"] > 0


def test_a_model_without_moe_layers_ignores_the_weights_and_records_them_as_not_applying(tmp_path, corpus_dir):
    runs = {}
    for name, weights in [("on", (0.5, 0.5)), ("off", (0.0, 0.0))]:
        runs[name] = run_train(TrainSettings(**{**TINY, "corpus": corpus_dir, "out": tmp_path / name, "max_steps": 2,
                                                "moe_balance_weight": weights[0], "moe_z_weight": weights[1]}),
                               show_progress=False)
        row = rows(tmp_path / name)[-1]
        assert row["moe_balance_weight"] is None and row["moe_z_weight"] is None and "moe_routing" not in row
    assert runs["on"]["val_bpb"] == runs["off"]["val_bpb"]
    a, b = (zoo.load(tmp_path / name / "checkpoint").state_dict() for name in ("on", "off"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # and a checkpoint of it continues under other weights, which change nothing for it
    more = TrainSettings(**{**TINY, "corpus": corpus_dir, "out": tmp_path / "off", "max_steps": 3,
                            "moe_balance_weight": 0.2})
    assert run_train(more, show_progress=False)["step"] == 3


def test_an_moe_checkpoint_continues_only_with_its_own_weights(tmp_path, corpus_dir):
    first = TrainSettings(**{**TINY, "arch": "moe", "corpus": corpus_dir, "out": tmp_path, "max_steps": 1})
    run_train(first, show_progress=False)
    other = TrainSettings(**{**TINY, "arch": "moe", "corpus": corpus_dir, "out": tmp_path, "max_steps": 2,
                             "moe_balance_weight": 0.0})
    with pytest.raises(ValueError, match=r"moe_balance_weight 0.01 \(checkpoint\) vs 0.0 \(now\)"):
        other.validate()


# ---- the balance loss balances --------------------------------------------------------------------------------------

def skewed_toy(seed: int = 0) -> tuple[MoE, torch.Tensor, torch.Tensor]:
    """An MoE whose router sends nearly every token to expert 0 (a constant input feature it weighs heavily), inputs
    and a regression target."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    moe = MoE(16, 16, n_experts=4, top_k=1, norm_topk_prob=False).train()
    x = torch.randn(64, 16, generator=generator)
    x[:, 0] = 1.0
    with torch.no_grad():
        moe.gate.weight[0, 0] = 2.0
    return moe, x, torch.randn(64, 16, generator=generator)


def train_toy(balance_weight: float, steps: int = 30) -> tuple[float, float]:
    """Load max/mean before and after `steps` Adam steps on the task loss plus the weighted balance loss."""
    moe, x, target = skewed_toy()
    aux = MoETraining(balance_weight, 0.0, applies=True)
    optimizer = torch.optim.Adam(moe.parameters(), lr=0.03)
    loads = []
    for _ in range(steps):
        task = torch.nn.functional.mse_loss(moe(x), target)
        loads.append(load_max_over_mean(moe.last_routing))
        loss = task + aux.step_loss(SimpleNamespace(blocks=[SimpleNamespace(mlp=moe)]))  # a one-layer stand-in
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        moe(x)
    return loads[0], load_max_over_mean(moe.last_routing)


def test_the_balance_weight_evens_out_a_skewed_router():
    before, balanced = train_toy(balance_weight=1.0)
    _, unbalanced = train_toy(balance_weight=0.0)
    assert before > 3.0  # nearly every token on one of the 4 experts
    assert balanced < before - 1.0 and balanced < unbalanced


# ---- zoo recall ---------------------------------------------------------------------------------------------------

def test_recall_training_reports_routing_and_keeps_accuracy_the_tasks():
    setting = MQARSetting(seq_len=32, num_kv_pairs=2, vocab_size=64)
    train, test = make_mqar(setting, 64, seed=1), make_mqar(setting, 16, seed=2)
    config = TrainConfig("moe", max_steps=4, eval_every=2, batch_size=16, vocab_size=64, moe_z_weight=0.01,
                         overrides={"n_experts": 4, "top_k": 2})
    result = train_recall(config, train, [test])
    assert (result["moe_balance_weight"], result["moe_z_weight"]) == (0.01, 0.01)
    assert [point["step"] for point in result["history"]] == [2, 4]
    for point in result["history"]:
        assert_routing_in_range(point["moe_routing"], 4, ["0", "1"])
        assert point_accuracy(point) == point["L=32,N=2"]  # the statistics are not counted as an accuracy
    assert result["moe_routing"] == result["history"][-1]["moe_routing"]
    dense = train_recall(TrainConfig("gqa", max_steps=2, eval_every=2, batch_size=16, vocab_size=64), train, [test])
    assert dense["moe_balance_weight"] is None and "moe_routing" not in dense["history"][-1]


def test_recall_runs_are_keyed_by_the_weights_that_apply():
    runs = RecallSettings(archs=["gqa", "moe"], moe_balance_weight=0.02).runs()
    weights = {run["arch"]: (run["moe_balance_weight"], run["moe_z_weight"]) for run in runs}
    assert weights == {"gqa": (None, None), "moe": (0.02, 0.001)}


# ---- bad weights ---------------------------------------------------------------------------------------------------

@pytest.fixture
def no_work(monkeypatch):
    monkeypatch.setattr(trainer, "load_corpus", fail_if_called("the corpus"))
    monkeypatch.setattr(zoo, "build", fail_if_called("zoo.build"))
    from harness.recall import suite
    monkeypatch.setattr(suite, "make_splits", fail_if_called("recall data"))
    monkeypatch.setattr(suite, "train_recall", fail_if_called("recall training"))


@pytest.mark.parametrize("command,argv", [("train", TRAIN), ("recall", RECALL)])
@pytest.mark.parametrize("option,value,message", [
    ("--moe-balance-weight", "-0.1", "moe_balance_weight must be a finite number >= 0, got -0.1"),
    ("--moe-balance-weight", "nan", "moe_balance_weight must be a finite number >= 0, got nan"),
    ("--moe-z-weight", "inf", "moe_z_weight must be a finite number >= 0, got inf"),
    ("--moe-z-weight", "-1", "moe_z_weight must be a finite number >= 0, got -1.0"),
])
def test_a_bad_weight_fails_before_work(tmp_path, capsys, no_work, command, argv, option, value, message):
    assert cli.main(argv + ["--out", str(tmp_path), option, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zoo {command}: error: ") and message in err and err.count("\n") == 1, err


def test_train_recall_checks_its_weights_before_building(monkeypatch):
    from harness.recall import train as recall_train
    monkeypatch.setattr(recall_train, "build_recall_model", fail_if_called("the model"))
    data = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="moe_z_weight must be a finite number >= 0, got -0.5"):
        train_recall(TrainConfig("moe", moe_z_weight=-0.5), data, [data])
