"""`zoo recall`: the MQAR sweep from the command line (options, presets, output files)."""
import argparse
from pathlib import Path

from harness.recall.report import markdown_table, write_report
from harness.recall.suite import RecallSettings, best_over_lr, run_recall
from harness.results import settings_dict
from harness.results import write_atomic

# A preset is a list of sweeps (one per sequence length) written to one results folder.
PRESETS = {
    "cpu-default": [{}],  # RecallSettings' defaults: every architecture, L=64, N in {4, 8}, d_model 32 and 64
    # Zoology's Fig. 2 grid: GPU-sized, runs anywhere, slowly
    "zoology-fig2": [
        {"seq_len": seq_len, "kv_pairs": [n], "d_models": [64, 128, 256, 512], "lrs": [1e-4, 4.6e-4, 2.2e-3, 1e-2],
         "train_examples": 100_000, "test_examples": 3_000, "max_steps": 20_000}
        for seq_len, n in ((64, 4), (128, 8), (256, 16), (512, 64))
    ],
}


def float_list(text: str) -> list[float]:
    try:
        return list(dict.fromkeys(float(part) for part in text.split(",") if part))  # repeats dropped, order kept
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_parser(sub, int_list, name_list) -> None:
    r = sub.add_parser("recall", help="train every architecture on associative recall (Zoology's MQAR) and chart it",
                       description="Train small models (2 layers, no MLP, tied embeddings) on MQAR for every "
                                   "architecture x d_model x learning rate; rows are appended to OUT/results.jsonl as "
                                   "each run finishes (a re-run skips finished runs); writes OUT/table.md (best over "
                                   "learning rates) and two charts. Options override the preset.")
    d = RecallSettings()
    r.add_argument("--preset", default="cpu-default", choices=list(PRESETS), help="sweep (default: cpu-default)")
    r.add_argument("--archs", type=name_list, help=f"comma-separated architectures (default: all: {','.join(d.archs)})")
    r.add_argument("--seq-len", type=int, help=f"sequence length L (default: {d.seq_len})")
    r.add_argument("--kv-pairs", type=int_list, help=f"comma-separated key-value pair counts N, trained as one mix "
                                                     f"(default: {','.join(map(str, d.kv_pairs))})")
    r.add_argument("--d-model", type=int_list, dest="d_models", help=f"comma-separated widths (default: {','.join(map(str, d.d_models))})")
    r.add_argument("--lrs", type=float_list, help=f"comma-separated learning rates; the best is reported (default: {','.join(map(str, d.lrs))})")
    r.add_argument("--vocab-size", type=int, help=f"vocabulary (default: {d.vocab_size})")
    r.add_argument("--train-examples", type=int, help=f"training examples per N (default: {d.train_examples})")
    r.add_argument("--test-examples", type=int, help=f"test examples per N (default: {d.test_examples})")
    r.add_argument("--max-steps", type=int, help=f"optimizer steps per run; stops early at accuracy > 0.99 (default: {d.max_steps})")
    r.add_argument("--batch-size", type=int, help=f"examples per step (default: {d.batch_size})")
    r.add_argument("--device", help=f"torch device, e.g. cpu or cuda (default: {d.device})")
    r.add_argument("--workers", type=int, help="runs trained at once, each in its own process (default: one per CPU "
                                               "core up to 2 on CPU; 1 on CUDA)")
    r.add_argument("--seed", type=int, help=f"seed for data, weights and shuffling (default: {d.seed})")
    r.add_argument("--out", help=f"output folder (default: {d.out})")
    r.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run each run as a Ray task: on the cluster at ADDRESS ('auto': the one this machine is in), "
                        "or without ADDRESS on a local instance; needs pip install -e '.[ray]'")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_recall)


OPTION_FIELDS = ("archs", "seq_len", "kv_pairs", "d_models", "lrs", "vocab_size", "train_examples", "test_examples",
                 "max_steps", "batch_size", "device", "workers", "seed", "ray")


def cmd_recall(args) -> None:
    given = {name: getattr(args, name) for name in OPTION_FIELDS if getattr(args, name) is not None}
    out = Path(args.out) if args.out else RecallSettings().out
    sweeps = [RecallSettings(**{**preset, **given, "out": out}) for preset in PRESETS[args.preset]]
    for settings in sweeps:
        settings.validate()  # every sweep's settings checked before the first one trains
    rows = [row for settings in sweeps for row in run_recall(settings, show_progress=not args.quiet)]
    best = best_over_lr(rows)
    table = markdown_table(best)
    write_atomic(out / "table.md", table)
    charts = write_report(best, out)
    print(table)
    print(f"settings: {[settings_dict(s) for s in sweeps]}")
    print(f"wrote {out / 'results.jsonl'}, {out / 'table.md'}, " + ", ".join(str(c) for c in charts))
