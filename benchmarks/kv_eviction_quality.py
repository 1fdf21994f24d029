"""What a smaller KV cache costs in quality, each model read through its cache one token a step
(harness/cached_bpb.py), keeping 1/2, 1/4, 1/8 and 1/16 of the context, by position (a sliding window; 4
StreamingLLM sinks and a window) or by score (H2O: half the budget the newest tokens, half heavy hitters; TOVA:
the newest query's attention alone; SnapKV: the pooled votes of the prompt's last queries, a quarter of the budget
at most 32 of them; "-pyramid": PyramidKV's taper of the scored part from the first layer to the last, the same
total), against the full cache. Every method at a budget holds the same number of
tokens a sequence, so the same cache bytes (an evicting layer also allocates one spare row, not counted here).

- lm: a `zoo train` language model (--weights), bits per byte on its corpus's fixed validation windows.
- mqar: a gqa model trained as `zoo recall` trains it (Zoology's MQAR, L 64, N = 4 and 8 mixed, d_model 64, two
  layers), the share of its test queries (N = 4, 8 and the held-out 16) answered; the first token is the prefill,
  so every key-value pair passes through the cache's decisions a step at a time.
- lm-arch: other `zoo train` language models (--arch-weights, trained as --weights was), each with its full cache,
  drawn on the lm chart: what another architecture's own cache costs and gives at its bytes.
- mqar-prompt: the same, with everything before a set's first query as the prompt (one prefill, scored whole, as
  SnapKV expects a long prompt), then the queries a token a step.
- mqar-arch: other architectures trained on the same MQAR data the same way (--mqar-archs; each at its registry
  learning rate), read through their own caches with the prompt as mqar-prompt's, drawn on its chart: recall at
  each architecture's own bytes beside eviction's.
- passkey: a number hidden in standard library text at a random depth, asked for at the end (harness/passkey.py),
  at 128, 256 and 512 bytes, by a gqa model trained on it with a length curriculum (saved to OUT/passkey_model, and
  loaded from there by a re-run); everything before the answer is the prompt, and each method keeps the same
  number of tokens (--passkey-budgets) at every length, so the needle lies ever further outside a window.

Rows go to OUT/results.jsonl as they finish (a re-run skips them); the chart (quality against cache bytes per
sequence) to OUT/quality_vs_bytes.png.

    python benchmarks/kv_eviction_quality.py --weights results/moe_quality/train/dense-total --windows 64
"""
import argparse
import copy
from pathlib import Path

import torch

import zoo
from cache import Retention
from harness.cached_bpb import cached_answers, cached_bits_per_byte
from harness.charts import line_chart
from harness.recall.suite import RecallSettings, make_data, train_config
from harness.recall.train import RECIPE_LAYERS, train_recall
from harness.passkey import DIGITS, PasskeyTraining, answered, passkey_examples, train_passkey
from harness.results import ResultStore, save_whole
from harness.train.corpus import load_corpus, validation_windows
from harness.train.checkpoint import checkpoint_folder, read_train_state

METHODS = ("window", "sinks+window", "h2o", "tova", "snapkv", "h2o-pyramid", "snapkv-pyramid")
FRACTIONS = (1 / 2, 1 / 4, 1 / 8, 1 / 16)
SINKS = 4  # StreamingLLM's
PASSKEY_LENGTHS = (128, 256, 512)


def with_retention(model, retention: Retention):
    """A copy whose full-attention layers keep by this positional policy (the weights unchanged)."""
    changed = copy.deepcopy(model)
    for block in changed.blocks:
        mixer = block.mixer
        if getattr(mixer, "retention", None) is not None and mixer.retention.keeps_all:
            mixer.retention, mixer.window, mixer.sinks = retention, retention.window, retention.sinks
    return changed


def kept_model(model, method: str, budget: int):
    if method == "window":
        return with_retention(model, Retention(window=budget))
    if method == "sinks+window":
        return with_retention(model, Retention(sinks=SINKS, window=budget - SINKS))
    policy, _, schedule = method.partition("-")  # "-pyramid": PyramidKV's taper of the scored part over depth
    return zoo.evict(model, policy=policy, budget=budget, schedule=schedule or "uniform")


def cache_bytes(model, length: int) -> int:
    """Bytes one sequence's cache holds at `length` tokens (float32)."""
    return sum(spec.bytes(length, torch.float32) for spec in model.cache_specs())


def budgets(context: int) -> list[tuple[str, int]]:
    """(method, tokens kept) for every method and share; sinks + window only where the window keeps two or more."""
    cells = []
    for fraction in FRACTIONS:
        budget = max(2, round(context * fraction))
        cells += [(m, budget) for m in METHODS if m != "sinks+window" or budget >= SINKS + 2]
    return cells


def lm_cells(args) -> tuple:
    state = read_train_state(args.weights)
    model = zoo.load(checkpoint_folder(args.weights)).float().eval()
    context = state["settings"]["context"]
    windows = validation_windows(load_corpus(state["settings"]["corpus"]), args.windows, context + 1).long()
    return model, context + 1, lambda kept: {"bpb": cached_bits_per_byte(kept, windows)}


def train_mqar(args, arch: str) -> tuple:
    """(model, test sets, what its training did): arch trained as `zoo recall` trains it, at its registry lr."""
    settings = RecallSettings(test_examples=args.mqar_examples, max_steps=args.mqar_steps)
    train, tests = make_data(settings, seed=0)
    config = train_config({"arch": arch, "n_layers": RECIPE_LAYERS, "d_model": 64,
                           "lr": zoo.registry.recall_lr(arch), "seed": 0}, settings)
    trained = train_recall(config, train, tests, keep_model=True)
    print(f"mqar {arch}: {trained['steps']} steps, uncached accuracy {trained['accuracy']:.3f}", flush=True)
    summary = {"steps": trained["steps"], "uncached_accuracy": trained["accuracy"],
               "convergence": trained["convergence"]}
    return trained["model"].float().eval(), tests, summary


def mqar_quality(tests: dict, prompted: bool):
    def prefix(labels) -> int:  # the prompt: up to the first query of any example of the set
        return int((labels >= 0).float().argmax(dim=1).min()) + 1 if prompted else 1

    def quality(kept) -> dict:
        accuracy = {name: cached_answers(kept, x, y, prefix(y)).float().mean().item() for name, (x, y) in tests.items()}
        return {"accuracy": sum(accuracy.values()) / len(accuracy), "per_set": accuracy}
    return quality


def mqar_cells(args, prompted: bool = False) -> tuple:
    model, tests, _ = train_mqar(args, "gqa")
    return model, next(iter(tests.values()))[0].shape[1], mqar_quality(tests, prompted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="lm,mqar,mqar-prompt", help="comma-separated: lm, lm-arch, mqar, "
                        "mqar-prompt, mqar-arch, passkey")
    parser.add_argument("--mqar-archs", default="mla,mamba2,swa", help="mqar-arch: comma-separated architectures")
    parser.add_argument("--arch-weights", default="", help="lm-arch: comma-separated `zoo train` output folders")
    parser.add_argument("--weights", type=Path, help="lm: a `zoo train` output folder")
    parser.add_argument("--windows", type=int, default=64, help="lm: validation windows scored per method and budget")
    parser.add_argument("--mqar-examples", type=int, default=500, help="mqar: test examples per N")
    parser.add_argument("--mqar-steps", type=int, default=1500, help="mqar: most training steps")
    parser.add_argument("--passkey-examples", type=int, default=200, help="passkey: examples per length")
    parser.add_argument("--passkey-budgets", default="64,32", help="passkey: tokens kept, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("results/kv_eviction_quality"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # context: the passkey task's example length (added after the other tasks' rows were written)
    store = ResultStore(args.out / "results.jsonl", ("task", "source", "method", "budget", "context"),
                        defaults={"context": None})
    for task in args.tasks.split(","):
        if task == "lm":
            state = read_train_state(args.weights) if args.weights else None
            if state is None:
                raise SystemExit(f"--weights {args.weights}: the lm task needs a `zoo train` output folder")
            source, context = str(args.weights), state["settings"]["context"]  # windows of context + 1 tokens
        elif task == "lm-arch":
            arch_rows(args, store)
            continue
        elif task == "mqar-arch":
            mqar_arch_rows(args, store)
            continue
        elif task == "passkey":
            passkey_rows(args, store)
            continue
        elif task in ("mqar", "mqar-prompt"):
            source, context = f"gqa L64 d64, {args.mqar_examples} tests per N, <= {args.mqar_steps} steps", 64
        else:
            raise SystemExit(f"unknown task {task!r}; allowed: lm, lm-arch, mqar, mqar-prompt, mqar-arch, "
                             f"passkey")
        cells = [{"task": task, "source": source, "method": method, "budget": budget, "context": None}
                 for method, budget in [("full", None)] + budgets(context)]
        todo = [cell for cell in cells if not store.done(cell)]
        if not todo:
            continue
        model, length, quality = lm_cells(args) if task == "lm" else mqar_cells(args, task == "mqar-prompt")
        for cell in todo:
            method, budget = cell["method"], cell["budget"]
            kept = model if method == "full" else kept_model(model, method, budget)
            store.append({**cell, **quality(kept), "cache_bytes": cache_bytes(kept, length)})
            print(task, method, budget, {k: v for k, v in store.rows[-1].items() if k not in cell}, flush=True)
    draw(store.rows, args.out)


def arch_rows(args, store: ResultStore) -> None:
    """Each other trained LM read through its own full cache, on the same validation windows as --weights'."""
    for folder in filter(None, args.arch_weights.split(",")):
        state = read_train_state(Path(folder))
        if state is None:
            raise SystemExit(f"--arch-weights {folder}: no `zoo train` checkpoint there")
        cell = {"task": "lm-arch", "source": folder, "method": state["settings"]["arch"], "budget": None,
                "context": None}
        if store.done(cell):
            continue
        model = zoo.load(checkpoint_folder(Path(folder))).float().eval()
        context = state["settings"]["context"]
        windows = validation_windows(load_corpus(state["settings"]["corpus"]), args.windows, context + 1).long()
        store.append({**cell, "bpb": cached_bits_per_byte(model, windows),
                      "cache_bytes": cache_bytes(model, context + 1),
                      "val_bpb_trained": state["history"][-1]["val_bpb"]})
        print("lm-arch", cell["method"], store.rows[-1]["bpb"], store.rows[-1]["cache_bytes"], flush=True)


def mqar_arch_rows(args, store: ResultStore) -> None:
    """Each other architecture trained on MQAR as the gqa model is, read through its own cache (pairs as a prompt)."""
    for arch in filter(None, args.mqar_archs.split(",")):
        cell = {"task": "mqar-arch", "source": f"L64 d64, {args.mqar_examples} tests per N, <= {args.mqar_steps} steps",
                "method": zoo.registry.check_architecture(arch), "budget": None, "context": None}
        if store.done(cell):
            continue
        model, tests, summary = train_mqar(args, arch)
        length = next(iter(tests.values()))[0].shape[1]
        store.append({**cell, **mqar_quality(tests, prompted=True)(model), **summary,
                      "cache_bytes": cache_bytes(model, length)})
        print("mqar-arch", arch, store.rows[-1]["accuracy"], store.rows[-1]["cache_bytes"], flush=True)


def passkey_model(out: Path, text):
    """The passkey model saved under out, or trained now and saved (written to a temporary folder, then renamed)."""
    folder = out / "passkey_model"
    if folder.exists():
        return zoo.load(folder).float().eval()
    model = train_passkey(PasskeyTraining(), text, progress=lambda length, steps, loss: print(
        f"passkey stage {length}: {steps} steps, loss {loss:.4f}", flush=True))
    save_whole(model, folder)
    return model


def passkey_rows(args, store: ResultStore) -> None:
    budgets = [int(b) for b in args.passkey_budgets.split(",")]
    source = f"gqa d64 2 layers, {PasskeyTraining().stages[-1]}-byte curriculum, {args.passkey_examples} examples"
    cells = [{"task": "passkey", "source": source, "method": method, "budget": budget, "context": length}
             for length in PASSKEY_LENGTHS for method, budget in
             [("full", None)] + [(m, b) for b in budgets for m in METHODS if m != "sinks+window" or b >= SINKS + 2]]
    todo = [cell for cell in cells if not store.done(cell)]
    if not todo:
        return
    text = load_corpus(None)
    model = passkey_model(args.out, text.train)
    tests = {n: passkey_examples(text.validation, args.passkey_examples, n, seed=1)[:2] for n in PASSKEY_LENGTHS}
    for cell in todo:
        inputs, labels = tests[cell["context"]]
        kept = model if cell["method"] == "full" else kept_model(model, cell["method"], cell["budget"])
        hits = cached_answers(kept, inputs, labels, prefix=cell["context"] - 2 * DIGITS + 2)  # the answer's first tag
        store.append({**cell, "accuracy": answered(hits).float().mean().item(), "digits": hits.float().mean().item(),
                      "cache_bytes": cache_bytes(kept, cell["context"])})
        print("passkey", cell["context"], cell["method"], cell["budget"], store.rows[-1]["accuracy"], flush=True)


def draw_passkey(rows: list[dict], out: Path) -> None:
    mine = [r for r in rows if r["task"] == "passkey"]
    if not mine:
        return
    for budget in sorted({r["budget"] for r in mine if r["budget"] is not None}, reverse=True):
        series = {m: tuple(zip(*sorted((r["context"], r["accuracy"]) for r in mine
                                       if r["method"] == m and r["budget"] == (None if m == "full" else budget))))
                  for m in ("full",) + METHODS if any(r["method"] == m for r in mine)}
        series["full cache"] = series.pop("full")
        line_chart(out / f"passkey_{budget}_tokens.png", f"pass key, {budget} tokens kept a layer (gqa, 2 layers)",
                   "context (bytes)", "keys answered (all 5 digits)", series, xticks=list(PASSKEY_LENGTHS),
                   legend={"fontsize": "small", "loc": "upper left", "bbox_to_anchor": (1.0, 1.0)})
        print(f"\npasskey, {budget} tokens kept (share of keys answered)")
        print("| method | " + " | ".join(f"L {n}" for n in PASSKEY_LENGTHS) + " |\n|---|"
              + "---:|" * len(PASSKEY_LENGTHS))
        for method, (_, values) in series.items():
            print(f"| {method} | " + " | ".join(f"{v:.3f}" for v in values) + " |")


def draw(rows: list[dict], out: Path) -> None:
    draw_passkey(rows, out)
    for task, metric, label in (("lm", "bpb", "bits per byte (read through the cache)"),
                                ("mqar", "accuracy", "MQAR accuracy (read through the cache)"),
                                ("mqar-prompt", "accuracy", "MQAR accuracy, pairs as one prompt")):
        mine = [r for r in rows if r["task"] == task]
        if not mine:
            continue
        full = next(r for r in mine if r["method"] == "full")
        series = {m: tuple(zip(*sorted((r["cache_bytes"], r[metric]) for r in mine if r["method"] == m)))
                  for m in METHODS if any(r["method"] == m for r in mine)}
        series["full cache"] = ([full["cache_bytes"]], [full[metric]])
        others = {"lm": "lm-arch", "mqar-prompt": "mqar-arch"}.get(task)  # architectures, each with its own cache
        series.update({f"{r['method']} (own cache)": ([r["cache_bytes"]], [r[metric]])
                       for r in rows if r["task"] == others})
        xs = [x for points, _ in series.values() for x in points]
        ticks = [2**k for k in range(min(xs).bit_length() - 1, max(xs).bit_length() + 1)]  # powers of two around
        line_chart(out / f"{task}_quality_vs_bytes.png", f"{task}: {full['source']}", "cache bytes per sequence",
                   label, series, xticks=ticks,
                   legend={"fontsize": "small", "loc": "upper left", "bbox_to_anchor": (1.0, 1.0)})
        print(f"\n{task} ({metric}), full cache {full[metric]:.3f}")
        print("| method | " + " | ".join(f"1/{round(1 / f)}" for f in FRACTIONS) + " |\n|---|" + "---:|" * 4)
        for method in METHODS:
            values = [f"{r[metric]:.3f}" for r in sorted((r for r in mine if r["method"] == method),
                                                         key=lambda r: -r["budget"])]
            print(f"| {method} | " + " | ".join(values + ["—"] * (len(FRACTIONS) - len(values))) + " |")


if __name__ == "__main__":
    main()
