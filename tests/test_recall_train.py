"""The MQAR trainer (harness/recall/train.py): attention learns recall, runs are deterministic, every
registered architecture trains and reports its state size."""
import pytest
import torch

import zoo
from harness.recall import MQARSetting, make_mqar
from harness.recall.train import (NEAR_CHANCE, TrainConfig, build_recall_model, diffusion_sequences, evaluate,
                                  model_identity, train_recall)

SETTING = MQARSetting(seq_len=64, num_kv_pairs=4)  # vocab 8192


@pytest.fixture(scope="module")
def small_data():
    return make_mqar(SETTING, 256, seed=1), make_mqar(SETTING, 64, seed=2)


@pytest.mark.parametrize("arch", zoo.architectures())
def test_every_architecture_trains(arch, small_data):
    train, test = small_data
    config = TrainConfig(arch, max_steps=3, eval_every=3, batch_size=16, vocab_size=8192)
    result = train_recall(config, train, [test])
    assert result["steps"] == 3
    assert result["state_bytes"] > 0
    assert 0.0 <= result["accuracy"] <= 1.0
    assert set(result["per_setting"]) == {"L=64,N=4"}
    assert result["history"] and result["history"][-1]["step"] == 3


def test_state_bytes_is_the_models_cache_at_the_longest_test_length(small_data):
    train, test = small_data
    long_test = make_mqar(MQARSetting(seq_len=128, num_kv_pairs=8), 16, seed=3)
    config = TrainConfig("gqa", max_steps=1, eval_every=1, batch_size=16, vocab_size=8192)
    result = train_recall(config, train, {"short": test, "long": long_test})
    model = build_recall_model(config, 8192, 128)
    assert result["state_bytes"] == zoo.cache_bytes(model, seq_len=128, dtype=torch.float32)
    assert set(result["per_setting"]) == {"short", "long"}


def test_recall_models_follow_the_recipe():
    model = build_recall_model(TrainConfig("swa"), vocab_size=8192, seq_len=64)
    assert all(block.mlp is None for block in model.blocks)
    assert model.head.weight is model.embed.weight
    assert model.config.n_layers == 2 and model.config.d_model == 64
    assert model.config.layers[0].params["window"] == 16  # L/4: the window matters at L=64
    assert model.config.layers[0].params["n_heads"] == 1  # one head of 64, as Zoology's recipe


def test_same_seed_same_run(small_data):
    train, test = small_data
    config = TrainConfig("gqa", max_steps=4, eval_every=2, batch_size=16, lr=3e-3, vocab_size=8192)
    a, b = train_recall(config, train, [test]), train_recall(config, train, [test])
    assert a["history"] == b["history"]
    assert a["per_setting"] == b["per_setting"]
    events = []
    c = train_recall(TrainConfig(**{**config.__dict__, "seed": 1}), train, [test], progress=events.append)
    assert [e["step"] for e in events] == [1, 2, 3, 4] and "eval" in events[1]
    assert [e["loss"] for e in events] != pytest.approx([0.0] * 4)
    assert c["steps"] == 4


def test_evaluate_reports_accuracies_in_range():
    model = build_recall_model(TrainConfig("gqa"), vocab_size=8192, seq_len=64)
    inputs, labels = make_mqar(SETTING, 2, seed=5)
    result = evaluate(model, inputs, labels)
    assert 0.0 <= result["accuracy"] <= 1.0 and 0.0 <= result["token_accuracy"] <= 1.0


def test_attention_solves_recall():
    """The issue's bar: gqa, 2 layers, d_model 64 on MQAR (L=64, N=4, vocab 8192) reaches >= 0.99 on CPU.
    Measured with this recipe (cosine over 1,200 steps, evaluated every 50): 0.9915 at step 700 (~45 s on one core);
    early stop ends the run there. Seeds 1-4 solve at steps 750-800, 400 steps inside the budget (over 1,000 steps,
    seed 2 stalled at 0.989; over 2,000 seeds 0-2 took 750-850 steps, 900 evaluated every 100)."""
    train, test = make_mqar(SETTING, 64000, seed=100), make_mqar(SETTING, 500, seed=999)
    config = TrainConfig("gqa", lr=3e-3, max_steps=1200, eval_every=50, vocab_size=8192)
    result = train_recall(config, train, [test])
    assert result["accuracy"] >= 0.99, result["history"]


def test_diffusion_sees_mqar_as_one_sequence_with_answers_in_place():
    """A diffusion LM's sequence is the inputs with each answer in the filler slot right after its query key."""
    inputs, labels = make_mqar(SETTING, 32, seed=7)
    tokens, answers = diffusion_sequences(inputs, labels)
    queries = labels != -100
    assert tokens.shape == inputs.shape and torch.equal(answers[:, 1:], queries[:, :-1]) and not answers[:, 0].any()
    assert torch.equal(tokens[answers], labels[queries])
    assert torch.equal(tokens[~answers], inputs[~answers])  # only the filler slots after query keys change
    assert (inputs[answers] != labels[queries]).float().mean() > 0.9  # the inputs never held the answers there


class Copier(torch.nn.Module):
    """A 'diffusion LM' that predicts the token at each position itself: perfect if an answer were visible."""

    def __init__(self, vocab: int):
        super().__init__()
        self.config = type("C", (), {"causal": False, "mask_token_id": vocab - 1})()
        self.head = torch.nn.Identity()
        self.vocab = vocab

    def hidden_states(self, tokens):
        return torch.nn.functional.one_hot(tokens, self.vocab).float()


def test_diffusion_evaluation_hides_every_answer():
    inputs, labels = make_mqar(SETTING, 16, seed=8)
    assert evaluate(Copier(8193), inputs, labels)["token_accuracy"] < 0.05  # it sees only mask tokens there


def test_architectures_with_one_identity_train_identically(small_data):
    """What lets the sweep train such twins once: same identity, same history (gqa = mha with one head)."""
    train, test = small_data
    runs = {a: TrainConfig(a, d_model=64, max_steps=3, eval_every=1, batch_size=16, vocab_size=8192) for a in ("mha", "gqa", "mla")}
    assert model_identity(runs["mha"], 8192, 64) == model_identity(runs["gqa"], 8192, 64) != model_identity(runs["mla"], 8192, 64)
    assert model_identity(TrainConfig("mha", d_model=128), 8192, 64) != model_identity(TrainConfig("gqa", d_model=128), 8192, 64)
    a, b = (train_recall(runs[x], train, [test]) for x in ("mha", "gqa"))
    assert a["history"] == b["history"] and a["state_bytes"] == b["state_bytes"]


def test_a_run_stops_at_a_plateau_only_after_min_steps(small_data, monkeypatch):
    """lr ~ 0 on the whole training set each step: the loss never moves, and the accuracy (held at 0.5, far above
    chance) neither, so the run is a plateau as soon as it has PLATEAU_PATIENCE + 1 evaluations; it stops there once
    min_steps are done, and without min_steps trains on to max_steps."""
    import harness.recall.train as train_module
    train, test = tuple(part[:64] for part in small_data[0]), small_data[1]  # 64 examples: one cheap full batch
    monkeypatch.setattr(train_module, "evaluate", lambda *a: {"accuracy": 0.5, "token_accuracy": 0.5})
    # chance so small that the untrained loss (~ln 8192) is under a uniform guess's: the loss rules do not object
    monkeypatch.setattr(train_module, "label_chance", lambda labels: 1e-6)
    common = dict(lr=1e-12, max_steps=12, eval_every=1, batch_size=len(train[0]), vocab_size=8192)
    stopped = train_recall(TrainConfig("gqa", min_steps=7, **common), train, [test])
    assert (stopped["steps"], stopped["convergence"], stopped["stopped"]) == (7, "plateau", "plateau")
    full = train_recall(TrainConfig("gqa", **common), train, [test])
    assert (full["steps"], full["convergence"], full["stopped"]) == (12, "plateau", "max_steps")


def test_a_run_at_chance_never_stops_at_a_plateau(small_data):
    """lr ~ 0: the accuracy never leaves chance, which is the flat stretch before recall starts, not a plateau."""
    train, test = tuple(part[:64] for part in small_data[0]), small_data[1]  # 64 examples: one cheap full batch
    common = dict(lr=1e-12, max_steps=12, eval_every=1, batch_size=len(train[0]), vocab_size=8192)
    result = train_recall(TrainConfig("gqa", min_steps=7, **common), train, [test])
    assert result["accuracy"] <= NEAR_CHANCE * result["chance"]
    assert (result["steps"], result["convergence"], result["stopped"]) == (12, "not converged", "max_steps")


def test_early_stop_looks_at_trained_settings_only(small_data, monkeypatch):
    """A held-out test set (an N never trained on) below target does not keep a solved run training."""
    import harness.recall.train as train_module
    train, test = small_data
    scores = {id(test[0]): 1.0}  # the trained set is solved at once; the held-out one never
    monkeypatch.setattr(train_module, "evaluate", lambda model, x, y, *a: {"accuracy": scores.get(id(x), 0.0),
                                                                            "token_accuracy": 0.0})
    held_out = (test[0].clone(), test[1])
    config = TrainConfig("gqa", max_steps=5, eval_every=1, batch_size=8, vocab_size=8192, trained_sets=("trained",))
    result = train_recall(config, train, {"trained": test, "held out": held_out})
    assert (result["steps"], result["solved"]) == (1, True)
    # the held-out set is scored once, at the end: in the result, not in the learning curve
    assert result["per_setting"]["held out"]["accuracy"] == 0.0
    [point] = result["history"]  # and the mean training loss since the previous evaluation
    assert point.pop("loss") > 0 and point == {"step": 1, "trained": 1.0}
    config.trained_sets = None  # every test set must pass: the held-out one never does
    result = train_recall(config, train, {"trained": test, "held out": held_out})
    assert (result["steps"], result["solved"]) == (5, False)
    with pytest.raises(ValueError, match=r"trained_sets \['nope'\] must name some of the test sets"):
        train_recall(TrainConfig("gqa", max_steps=1, trained_sets=("nope",)), train, {"trained": test})


def test_warmup_then_cosine():
    from harness.recall.train import lr_factor
    config = TrainConfig("gqa", max_steps=110, warmup_steps=10)
    assert [lr_factor(s, config) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert lr_factor(10, config) == 1.0 and abs(lr_factor(60, config) - 0.5) < 1e-12 and lr_factor(110, config) == 0.0
