"""Dense vs MoE at an equal training budget: quality, beside benchmarks/moe_tradeoff.py's speed. The registry's moe
entry and the two dense gqa models of that script (a SwiGLU as wide as the experts a token applies: equal active
parameters; as wide as all of them: equal total), each trained for the same steps on the same batches:

- bits per byte on held-out standard-library text (zoo train's trainer: byte-level, its context, batch and lr);
- MQAR recall (zoo recall's trainer and data: L 64, trained on N = 4, 8, tested on 4, 8, 16), with one change to
  the recall recipe: every model keeps its feed-forward (the recipe drops the MLP), since the feed-forward is what
  differs here. The recall models are d_model 64 and 2 layers, the tiny preset's widths.

The MoE trains with the Switch load-balancing loss and the router z-loss at their defaults (zoo train's
--moe-balance-weight / --moe-z-weight); its routing statistics at the end are recorded. Rows go to OUT/results.jsonl
as each run finishes (a re-run skips finished runs); the table is printed and written to OUT/table.md.

    python benchmarks/moe_quality.py                                 # tiny preset, 600 LM steps, 1500 MQAR steps
    python benchmarks/moe_quality.py --lm-steps 20 --mqar-steps 20 --out /tmp/moe_quality    # a smoke run
"""
import argparse
import sys
from pathlib import Path

import torch

from harness.recall.data import MQARSetting, make_splits
from harness.recall.train import TrainConfig, train_recall
from harness.results import ResultStore, check_output_folder, write_atomic
from harness.train.settings import TrainSettings
from harness.train.trainer import run_train
import zoo
from moe_tradeoff import MODELS, equal_ffn_widths  # benchmarks/, beside this script when run as one
from zoo import checks

RUN_KEY = ("model", "task", "preset", "steps", "seed")
MQAR_LENGTH, MQAR_TRAINED, MQAR_TESTED, MQAR_VOCAB = 64, (4, 8), (4, 8, 16), 8192
MQAR_LR = 2e-3  # the registry's recall_lr for gqa and moe
TABLE = [("model", "model", "{}"), ("params total (M)", "params_total_m", "{:.3f}"),
         ("val bpb", "val_bpb", "{:.3f}"), ("MQAR acc", "mqar_accuracy", "{:.3f}"),
         ("MQAR N=16", "mqar_n16", "{:.3f}"), ("LM train s", "lm_train_s", "{:.0f}"),
         ("load max/mean", "load_max_over_mean", "{:.2f}"), ("entropy (nats)", "entropy_nats", "{:.2f}")]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="language-model size (default: tiny)")
    p.add_argument("--lm-steps", type=int, default=600, help="zoo train steps per model (default: 600)")
    p.add_argument("--mqar-steps", type=int, default=1500,
                   help="MQAR steps per model (default: 1500, zoo recall's CPU default)")
    p.add_argument("--mqar-examples", type=int, default=32000, help="MQAR training examples per N (default: 32000)")
    p.add_argument("--mqar-test-examples", type=int, default=500, help="MQAR test examples per N (default: 500)")
    p.add_argument("--eval-windows", type=int, default=256,
                   help="validation windows the bits per byte are measured on (default: zoo train's 256)")
    p.add_argument("--corpus", default=None, help="text file or folder (default: this Python's standard library)")
    p.add_argument("--seed", type=int, default=0, help="weights, batches and data (default: 0)")
    p.add_argument("--out", default="results/moe_quality", help="results folder (default: results/moe_quality)")
    return p


def validate(args) -> None:
    for name in ("lm_steps", "mqar_steps", "mqar_examples", "mqar_test_examples", "eval_windows"):
        checks.integer(name, getattr(args, name), minimum=1)
    checks.integer("seed", args.seed, minimum=0)
    check_output_folder(Path(args.out))


def arch_and_overrides(model: str, widths: dict[str, int]) -> tuple[str, dict]:
    return ("moe", {}) if model == "moe" else ("gqa", {"mlp_hidden": widths[model]})


def routing_summary(routing: dict | None) -> dict:
    """The MoE's routing over the last quarter of its steps, averaged over its layers (None for a dense model)."""
    if not routing:
        return {"load_max_over_mean": None, "entropy_nats": None}
    return {"load_max_over_mean": routing["load_max_over_mean"], "entropy_nats": routing["entropy_nats"]}


def parameters(arch: str, preset: str, overrides: dict) -> int:
    with torch.device("meta"):  # counted, not allocated
        return zoo.parameter_counts(zoo.build(arch, preset=preset, **overrides)).total


def language_model_run(model: str, widths: dict, args) -> dict:
    arch, overrides = arch_and_overrides(model, widths)
    settings = TrainSettings(arch=arch, preset=args.preset, overrides=overrides, minutes=None,
                             max_steps=args.lm_steps, eval_every=max(1, args.lm_steps // 4), seed=args.seed,
                             eval_windows=args.eval_windows, corpus=args.corpus, out=Path(args.out) / "train" / model)
    settings.validate()
    result = run_train(settings, show_progress=False)
    return {"val_bpb": result["val_bpb"], "lm_train_s": result["trained_s"],
            "params_total": parameters(arch, args.preset, overrides), **routing_summary(result.get("moe_routing"))}


def mqar_data(args):
    trained = [MQARSetting(MQAR_LENGTH, n, MQAR_VOCAB) for n in MQAR_TRAINED]
    tested = [MQARSetting(MQAR_LENGTH, n, MQAR_VOCAB) for n in MQAR_TESTED]
    (inputs, labels, _), tests = make_splits([(s, args.mqar_examples) for s in trained],
                                             [(s, args.mqar_test_examples) for s in tested], args.seed)
    return (inputs, labels), {f"N={n}": test for n, test in zip(MQAR_TESTED, tests)}


def recall_run(model: str, widths: dict, args, data) -> dict:
    arch, overrides = arch_and_overrides(model, widths)
    config = TrainConfig(arch=arch, d_model=64, lr=MQAR_LR, max_steps=args.mqar_steps, seed=args.seed,
                         overrides={"mlp": "swiglu", **overrides},
                         trained_sets=tuple(f"N={n}" for n in MQAR_TRAINED))
    result = train_recall(config, *data)
    return {"mqar_accuracy": result["accuracy"], "mqar_n16": result["per_setting"]["N=16"]["accuracy"],
            "mqar_steps_run": result["steps"]}


def run(args) -> list[dict]:
    widths = equal_ffn_widths(args.preset)
    recall_widths = equal_ffn_widths("tiny")  # the recall models are the tiny preset's width
    store = ResultStore(Path(args.out) / "results.jsonl", RUN_KEY)
    data = None
    for model in MODELS:
        for task, steps in (("lm", args.lm_steps), ("mqar", args.mqar_steps)):
            key = {"model": model, "task": task, "preset": args.preset, "steps": steps, "seed": args.seed}
            if store.done(key):
                continue
            torch.manual_seed(args.seed)
            if task == "lm":
                row = language_model_run(model, widths, args)
            else:
                data = data or mqar_data(args)
                row = recall_run(model, recall_widths, args, data)
            store.append({**key, **row})
            print(f"{model} {task}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()
                                                   if isinstance(v, float)), flush=True)
    steps = {"lm": args.lm_steps, "mqar": args.mqar_steps}
    return [r for r in store.rows if r["preset"] == args.preset and r["seed"] == args.seed
            and r["steps"] == steps[r["task"]]]


def merged(rows: list[dict]) -> list[dict]:
    """One row per model: its language-model and recall runs side by side."""
    out = []
    for model in MODELS:
        row = {"model": model}
        for r in rows:
            if r["model"] == model:
                row.update({k: v for k, v in r.items() if k not in RUN_KEY})
        row["params_total_m"] = row["params_total"] / 1e6 if "params_total" in row else None
        out.append(row)
    return out


def markdown(rows: list[dict]) -> str:
    cell = lambda r, key, fmt: "-" if r.get(key) is None else fmt.format(r[key])  # noqa: E731
    lines = ["| " + " | ".join(t for t, _, _ in TABLE) + " |",
             "|" + "|".join("---" if k == "model" else "---:" for _, k, _ in TABLE) + "|"]
    lines += ["| " + " | ".join(cell(r, k, fmt) for _, k, fmt in TABLE) + " |" for r in merged(rows)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        validate(args)
    except ValueError as error:
        print(f"moe_quality: error: {error}", file=sys.stderr)
        return 2
    rows = run(args)
    report = markdown(rows)
    print(report)
    write_atomic(Path(args.out) / "table.md", report)
    print(f"wrote {Path(args.out) / 'results.jsonl'}, {Path(args.out) / 'table.md'}")
    return 0


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        status = main()
    sys.exit(status)
