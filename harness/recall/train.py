"""Train a zoo architecture on MQAR (Zoology's recipe, Arora et al. 2023) and measure its recall.

Recipe: 2 layers, no MLP, tied embeddings, pre-norm; AdamW (weight decay 0.1), cosine schedule over
max_steps, no warmup; cross-entropy over the full vocabulary at the labelled (query) positions only;
evaluation every eval_every steps, early stop once every trained setting's test set is above target_accuracy.

Converge or explain: a run ends "solved" (every trained setting's test set above target_accuracy), "plateau" (its
test accuracy on the trained settings gained less than PLATEAU_GAIN, or less than PLATEAU_ERROR_SHARE of its
remaining error, over its last PLATEAU_PATIENCE evaluations, while its accuracy is above NEAR_CHANCE times chance,
its training loss is below a uniform guess's among the label values (-ln chance), and that loss fell by no more
than PLATEAU_LOSS_FALL over those evaluations: more steps would not change the row), or "not converged" (anything
else: the step budget ended while it was still learning, or before it started). MQAR curves sit flat and then jump
(the induction transition); a flat accuracy whose loss is still falling, or still at a uniform guess's, is the flat
part before the jump, not a plateau. Only the first two
are an architecture's recall at this setting; reports mark the third. With min_steps set, a run also stops at a
plateau once it has trained that many steps, and gives its time to the runs that are still learning; `stopped` says
why each run ended. Held-out settings (test sets of an N never trained on) are scored once, at the end.

For CPU speed the vocabulary head (8192 wide) runs only at labelled positions: the hidden states
come from `model.hidden_states` (the forward without the head), then `model.head` on the gathered rows.

A model with MoE layers also trains on the MoE auxiliary losses (load balancing and router z-loss, weighted by
moe_balance_weight and moe_z_weight; harness/train/moe_losses.py); its loss and accuracies stay the task's, and each
evaluation point carries the routing statistics of the steps before it ("moe_routing").

A masked diffusion LM (non-causal) sees the whole sequence, so the next-token recipe would hand it the answers.
It trains with its own objective instead (LLaDA's, on the answers only, as LLaDA fine-tunes on responses: the
key-value pairs and query keys stay visible) and is evaluated by masking every answer and predicting them all in
one forward pass.
"""
import dataclasses
import hashlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import zoo
from harness.diffusion import masked_diffusion_loss
from harness.recall.data import IGNORE_INDEX, accuracy
from harness.train.moe_losses import BALANCE_WEIGHT, Z_WEIGHT, MoETraining, check_weights


RECIPE_LAYERS = 2  # Zoology's MQAR recipe; deeper runs where an entry's recall_layers asks
PLATEAU_PATIENCE = 3  # evaluations (300 steps at eval_every 100)
PLATEAU_GAIN = 0.01  # mean test accuracy
# near the top a smaller gain is still learning: attention seeds polishing 0.977 toward 0.99 stopped at 0.98 with the
# absolute rule alone (BENCHMARKS.md)
PLATEAU_ERROR_SHARE = 0.1
NEAR_CHANCE = 2.0  # accuracy within this multiple of chance has not started to recall: never a plateau
# a training loss that fell by more than this fraction over the patience window is still learning (BENCHMARKS.md:
# the evidence for the value, from full learning curves across widths, seeds and learning rates)
PLATEAU_LOSS_FALL = 0.005
# ... where the fall is real: the window means' least-squares slope at least this many standard errors below zero
# (near a solved loss of ~0.15 nats the means wander by up to 8% between windows; BENCHMARKS.md)
LOSS_FALL_T = 2.0
# a fall from the window's first mean to its last larger than this is learning however the means scatter (zoo
# probe's attention on in-context recall: 2.22, 1.95, 1.94, 1.93, a 13% fall whose slope is 1.95 standard errors)
PLATEAU_LOSS_DROP = 0.1
# a causal model's training loss is the next-token cross-entropy at the labelled positions, comparable with a uniform
# guess's; a diffusion LM's is LLaDA's 1/t-weighted loss, which is not, so its points keep it under another name
LOSS_FIELD, DIFFUSION_LOSS_FIELD = "loss", "diffusion_loss"
ROUTING_FIELD = "moe_routing"  # an MoE model's routing statistics (harness/train/moe_losses.py)
# a history point's fields that are not an accuracy
POINT_FIELDS = ("step", LOSS_FIELD, DIFFUSION_LOSS_FIELD, ROUTING_FIELD)


def point_accuracy(point: dict) -> float:
    """A history point's mean accuracy over its test sets."""
    accuracies = [v for k, v in point.items() if k not in POINT_FIELDS]
    return sum(accuracies) / max(1, len(accuracies))


def loss_fall(history: list[dict]) -> float | None:
    """The training loss's fall over the last PLATEAU_PATIENCE evaluations, as a fraction of where it stood before
    them: the first-to-last fall where that exceeds PLATEAU_LOSS_DROP, else the fall read off the least-squares line
    through those window means, 0 where that line's slope is not LOSS_FALL_T standard errors below zero (the means
    wander, not fall); None where the points carry no loss (older rows)."""
    losses = [point.get(LOSS_FIELD) for point in history[-PLATEAU_PATIENCE - 1:]]
    if len(losses) <= PLATEAU_PATIENCE or None in losses:
        return None
    if losses[0] > 0 and (losses[0] - losses[-1]) / losses[0] > PLATEAU_LOSS_DROP:
        return (losses[0] - losses[-1]) / losses[0]
    n = len(losses)
    x_mean, y_mean = (n - 1) / 2, sum(losses) / n
    sxx = sum((x - x_mean) ** 2 for x in range(n))
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(range(n), losses)) / sxx
    start = y_mean - slope * x_mean
    residual = sum((y - start - slope * x) ** 2 for x, y in zip(range(n), losses))
    standard_error = math.sqrt(residual / (n - 2) / sxx)
    if start <= 0 or -slope <= LOSS_FALL_T * standard_error:
        return 0.0
    return -slope * (n - 1) / start


def convergence(history: list[dict], solved: bool, chance: float = 0.0) -> str:
    """"solved", "plateau" or "not converged" from a run's evaluations (history points: step, mean training loss
    since the previous evaluation, accuracy per test set). A plateau: the best mean accuracy over the last
    PLATEAU_PATIENCE evaluations beats the best before them by less than PLATEAU_GAIN and by less than
    PLATEAU_ERROR_SHARE of the error left (1 - that best), that best is above NEAR_CHANCE x chance, the training
    loss is below -ln(chance) (a uniform guess among the label values) and fell by no more than PLATEAU_LOSS_FALL
    over those evaluations."""
    if solved:
        return "solved"
    means = [point_accuracy(point) for point in history]
    if len(means) <= PLATEAU_PATIENCE:
        return "not converged"
    recent, before = max(means[-PLATEAU_PATIENCE:]), max(means[:-PLATEAU_PATIENCE])
    if recent <= NEAR_CHANCE * chance:
        return "not converged"
    loss = history[-1].get(LOSS_FIELD)
    if chance > 0 and loss is not None and loss >= -math.log(chance):
        return "not converged"
    fall = loss_fall(history)
    if fall is not None and fall > PLATEAU_LOSS_FALL:
        return "not converged"
    return "plateau" if recent - before < min(PLATEAU_GAIN, PLATEAU_ERROR_SHARE * (1 - before)) else "not converged"


def label_chance(labels: torch.Tensor) -> float:
    """Accuracy of a uniform guess among the values the labels take (MQAR: the V/2 value ids)."""
    values = labels[labels != IGNORE_INDEX]
    return 1.0 / max(1, int(values.unique().numel()))


@dataclass
class TrainConfig:
    arch: str
    d_model: int = 64
    n_layers: int = RECIPE_LAYERS
    lr: float = 1e-3
    warmup_steps: int = 0  # linear warmup before the cosine decay (Zoology's recipe has none)
    weight_decay: float = 0.1
    batch_size: int = 64
    max_steps: int = 2000
    min_steps: int | None = None  # stop at a plateau after this many steps (None: train on to max_steps)
    eval_every: int = 100
    target_accuracy: float = 0.99
    seed: int = 0
    device: str = "cpu"
    vocab_size: int | None = None  # default: the data's largest id rounded up to a power of two (8192 for MQAR)
    n_heads: int | None = None  # default max(1, d_model // 64): head dim 64, Zoology's one head at d_model 64
    eval_batch_size: int = 256
    overrides: dict | None = None  # extra zoo.build settings (replace the per-architecture defaults)
    trained_sets: tuple[str, ...] | None = None  # test sets of trained settings (early stop); None: all of them
    chance: float | None = None  # a uniform guess's test accuracy; None: from the training labels' values (MQAR)
    moe_balance_weight: float = BALANCE_WEIGHT  # the MoE auxiliary losses' weights; a model without MoE ignores them
    moe_z_weight: float = Z_WEIGHT


def recall_model_config(config: TrainConfig, vocab_size: int, seq_len: int) -> zoo.ModelConfig:
    # one 64-wide head at d_model 64, as Zoology: two 32-wide heads plateaued lower (BENCHMARKS.md)
    n_heads = config.n_heads or max(1, config.d_model // 64)
    settings = {"mlp": "none", **zoo.registry.recall_settings(config.arch, config.d_model, n_heads, seq_len)}
    settings.update(config.overrides or {})  # e.g. `zoo probe`'s channel mixer (mlp, mlp_hidden)
    return zoo.make_config(
        config.arch, preset="tiny", d_model=config.d_model, n_layers=config.n_layers, n_heads=n_heads,
        vocab_size=vocab_size, tie_embeddings=True, max_seq_len=seq_len, **settings,
    )


def build_recall_model(config: TrainConfig, vocab_size: int, seq_len: int) -> torch.nn.Module:
    return zoo.build(recall_model_config(config, vocab_size, seq_len))


def model_identity(config: TrainConfig, vocab_size: int, seq_len: int) -> str:
    """Two architectures that build the same model at this size (mha, gqa and mqa with one head; the hybrids
    tiled to 2 layers) train to the same result: everything but the name, as a short digest."""
    model = dataclasses.replace(recall_model_config(config, vocab_size, seq_len), name="")
    return hashlib.sha256(repr(model).encode()).hexdigest()[:16]


def labelled_logits(model, inputs: torch.Tensor, labels: torch.Tensor):
    """Logits [M, vocab] at the M labelled positions, with their targets [M] and mask [B, T]. A diffusion LM
    predicts each answer at its own (masked) position; an autoregressive one at the position before it."""
    if not model.config.causal:
        tokens, answers = diffusion_sequences(inputs, labels)
        h = model.hidden_states(tokens.masked_fill(answers, model.config.mask_token_id))
        logits = model.head(h[answers])
        logits[:, model.config.mask_token_id] = float("-inf")  # an answer is a token, never "still masked"
        return logits, tokens[answers], answers
    mask = labels != IGNORE_INDEX
    h = model.hidden_states(inputs)
    return model.head(h[mask]), labels[mask], mask


def diffusion_sequences(inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MQAR as a diffusion LM sees it: each answer in the slot after its query key (Zoology leaves that slot
    filler: the value never follows the query in the input). Returns tokens [B, L] and where the answers are."""
    if (labels[:, -1] != IGNORE_INDEX).any():
        raise ValueError("a query at the last position has no slot after it for a diffusion LM's answer")
    answers = F.pad(labels[:, :-1] != IGNORE_INDEX, (1, 0))
    tokens = inputs.clone()
    tokens[answers] = labels[labels != IGNORE_INDEX]
    return tokens, answers


def training_loss(model, inputs: torch.Tensor, labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if not model.config.causal:
        tokens, answers = diffusion_sequences(inputs, labels)
        return masked_diffusion_loss(model, tokens, generator=generator, loss_mask=answers)
    logits, targets, _ = labelled_logits(model, inputs, labels)
    return F.cross_entropy(logits, targets)


@torch.no_grad()
def evaluate(model, inputs: torch.Tensor, labels: torch.Tensor, batch_size: int = 256, device: str = "cpu") -> dict:
    """Argmax at labelled positions, scored by data.accuracy: per-example accuracy (mean over an example's
    queries, then over examples) and per-token accuracy (over all queries); 0.0 for a set with no queries."""
    was_training = model.training
    model.eval()
    predicted, expected = [], []
    for start in range(0, len(inputs), batch_size):
        logits, targets, mask = labelled_logits(model, inputs[start:start + batch_size].to(device),
                                                labels[start:start + batch_size].to(device))
        guess = torch.full(mask.shape, IGNORE_INDEX, dtype=torch.long, device=device)
        answer = guess.clone()
        guess[mask], answer[mask] = logits.argmax(-1), targets  # each answer where the model predicted it
        predicted.append(guess.cpu())
        expected.append(answer.cpu())
    model.train(was_training)
    if not predicted:
        return {"accuracy": 0.0, "token_accuracy": 0.0}
    scores = accuracy(torch.cat(predicted), torch.cat(expected))
    return {"accuracy": 0.0 if math.isnan(scores["per_example"]) else scores["per_example"],
            "token_accuracy": 0.0 if math.isnan(scores["per_token"]) else scores["per_token"]}


def test_set_items(test_sets) -> list[tuple[str, tuple[torch.Tensor, torch.Tensor]]]:
    """test_sets: {name: (inputs, labels)} or a sequence of (inputs, labels) (named by (L, N))."""
    if isinstance(test_sets, dict):
        return [(str(k), v) for k, v in test_sets.items()]
    items = []
    for inputs, labels in test_sets:
        n = int((labels[0] != IGNORE_INDEX).sum())
        items.append((f"L={inputs.shape[1]},N={n}", (inputs, labels)))
    return items


def train_recall(config: TrainConfig, train_data, test_sets, progress: Callable[[dict], None] | None = None,
                 keep_model: bool = False) -> dict:
    """Train config.arch on train_data = (inputs [n, L], labels [n, L]); evaluate on test_sets.

    progress, if given, is called after every step with {"step", "max_steps", "loss"} and after every
    evaluation with "eval" added ({name: accuracy}).
    Returns accuracy (mean per-example accuracy over the test sets), token_accuracy, per_setting
    ({name: {"accuracy", "token_accuracy"}}), steps, solved, convergence (see convergence()), wall_s, state_bytes,
    parameters, history (the learning curve: accuracy per test set at every evaluation); with keep_model, also the
    trained model (what a later measurement of the same weights, e.g. quantized, starts from). A model with MoE layers
    also gets moe_routing (the last evaluation point's) and the weights applied; None weights: no MoE layers.
    """
    check_weights(config.moe_balance_weight, config.moe_z_weight)
    start_time = time.perf_counter()
    device = config.device
    train_inputs, train_labels = train_data
    tests = test_set_items(test_sets)
    unknown = set(config.trained_sets or ()) - {name for name, _ in tests}
    if unknown or config.trained_sets == ():
        raise ValueError(f"trained_sets {sorted(unknown) or '()'} must name some of the test sets: "
                         f"{[name for name, _ in tests]}")
    vocab_size = max([int(train_inputs.max())] + [int(x.max()) for _, (x, _) in tests]) + 1
    vocab_size = max(vocab_size, int(train_labels.max()) + 1)
    vocab_size = config.vocab_size or _round_vocab(vocab_size)
    seq_len = max([train_inputs.shape[1]] + [x.shape[1] for _, (x, _) in tests])

    torch.manual_seed(config.seed)
    model = build_recall_model(config, vocab_size, seq_len).to(device)
    mask_generator = torch.Generator(device).manual_seed(config.seed + 1)  # a diffusion LM's masking draws
    model.train()
    moe = MoETraining.for_model(model, config.moe_balance_weight, config.moe_z_weight)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    generator = torch.Generator().manual_seed(config.seed)

    n = len(train_inputs)
    chance = config.chance if config.chance is not None else label_chance(train_labels)
    order, cursor = torch.randperm(n, generator=generator), 0
    history, results, step, solved, window_losses = [], {}, 0, False, []
    moe_report = moe.report()  # the weights applied; with routing statistics once a step has run

    def run_eval(final: bool = False):
        """During training the trained settings' test sets (the learning curve); at the end every set."""
        res = {name: evaluate(model, x, y, config.eval_batch_size, device) for name, (x, y) in tests
               if final or config.trained_sets is None or name in config.trained_sets}
        if not final or not history or history[-1]["step"] != step:
            field = LOSS_FIELD if zoo.is_causal(config.arch) else DIFFUSION_LOSS_FIELD
            loss = {field: sum(window_losses) / len(window_losses)} if window_losses else {}
            report = moe.report()  # routing statistics only where steps ran since the last point
            moe_report.update(report)
            routing = {ROUTING_FIELD: report[ROUTING_FIELD]} if ROUTING_FIELD in report else {}
            history.append({"step": step, **loss, **routing, **{name: r["accuracy"] for name, r in res.items()
                                                                if config.trained_sets is None
                                                                or name in config.trained_sets}})
            window_losses.clear()
        return res

    while step < config.max_steps:
        if cursor + config.batch_size > n:  # a new shuffled epoch (drop the ragged tail)
            order, cursor = torch.randperm(n, generator=generator), 0
        idx = order[cursor:cursor + min(config.batch_size, n)]
        cursor += len(idx)
        x, y = train_inputs[idx].to(device), train_labels[idx].to(device)
        loss = training_loss(model, x, y, mask_generator)
        optimizer.zero_grad(set_to_none=True)
        (loss + moe.step_loss(model)).backward()
        optimizer.step()
        scheduler.step()
        step += 1
        event = {"step": step, "max_steps": config.max_steps, "loss": float(loss.detach())}
        window_losses.append(event["loss"])
        if step % config.eval_every == 0 or step == config.max_steps:
            results = run_eval()
            event["eval"] = {name: r["accuracy"] for name, r in results.items()}
            solved = all(r["accuracy"] > config.target_accuracy for name, r in results.items()
                         if config.trained_sets is None or name in config.trained_sets)
        if progress is not None:
            progress(event)
        if solved or (config.min_steps is not None and step >= config.min_steps and "eval" in event
                      and convergence(history, solved, chance) == "plateau"):
            break
    if len(results) < len(tests):  # held-out sets (only evaluated at the end) or max_steps == 0
        results = run_eval(final=True)

    return {
        "arch": config.arch,
        "config": asdict(config),
        "accuracy": sum(r["accuracy"] for r in results.values()) / len(results),
        "token_accuracy": sum(r["token_accuracy"] for r in results.values()) / len(results),
        "per_setting": results,
        "steps": step,
        "solved": solved,
        "convergence": convergence(history, solved, chance),
        "stopped": "solved" if solved else "max_steps" if step >= config.max_steps else "plateau",
        "chance": chance,
        "wall_s": time.perf_counter() - start_time,
        "state_bytes": zoo.cache_bytes(model, seq_len=seq_len, dtype=torch.float32),
        "parameters": sum(p.numel() for p in model.parameters()),
        "history": history,
        **moe_report,
        **({"model": model.eval()} if keep_model else {}),
    }


def lr_factor(step: int, config: TrainConfig) -> float:
    """The learning rate at `step` as a fraction of config.lr: linear warmup, then cosine decay to 0 at max_steps."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    decay_steps = max(1, config.max_steps - config.warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(step - config.warmup_steps, decay_steps) / decay_steps))


def _round_vocab(v: int) -> int:
    """The vocabulary the data implies, rounded up to a power of two (MQAR uses 8192: ids up to 8191)."""
    return 1 << max(0, (v - 1).bit_length())
