"""`zoo recall`: the MQAR sweep from the command line (options, presets, output files)."""
import argparse
from pathlib import Path

from harness.recall.report import markdown_table, write_report
from harness.recall.suite import RecallSettings, best_over_lr, run_recall
from harness.results import settings_dict
from harness.results import write_atomic
from harness.train.cli import add_moe_weight_options

# A preset is a list of sweeps (one per sequence length) written to one results folder.
PRESETS = {
    # RecallSettings' defaults: the recall_default architectures at L=64, trained on N in {4, 8} and also tested on
    # 16, d_model 64 (and 32 for the fixed-state ones), each at its registry learning rate, one seed
    "cpu-default": [{}],
    # Zoology's Fig. 2 grid: GPU-sized, runs anywhere, slowly
    "zoology-fig2": [
        {"seq_len": seq_len, "kv_pairs": [n], "held_out_kv_pairs": [], "d_models": [64, 128, 256, 512],
         "state_d_models": [], "lrs": [1e-4, 4.6e-4, 2.2e-3, 1e-2], "train_examples": 100_000, "test_examples": 3_000,
         "min_steps": 2_000, "max_steps": 20_000, "seeds": [0, 1, 2]}
        for seq_len, n in ((64, 4), (128, 8), (256, 16), (512, 64))
    ],
}


def float_list(text: str) -> list[float]:
    try:
        return list(dict.fromkeys(float(part) for part in text.split(",") if part))  # repeats dropped, order kept
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_ray_option(parser) -> None:
    """--ray [ADDRESS], as zoo recall and zoo probe take it."""
    parser.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                        help="run each run as a Ray task: on the cluster at ADDRESS ('auto': the one this machine is "
                             "in), or without ADDRESS on a local instance; needs pip install -e '.[ray]'")


def add_parser(sub, int_list, name_list) -> None:
    r = sub.add_parser("recall", help="train every architecture on associative recall (Zoology's MQAR) and chart it",
                       description="Train small models (2 layers, no MLP, tied embeddings) on MQAR for every "
                                   "architecture x d_model x learning rate x seed; rows are appended to OUT/results.jsonl as "
                                   "each run finishes (a re-run skips finished runs); writes OUT/table.md (best over "
                                   "learning rates) and three charts. Options override the preset.")
    d = RecallSettings()
    r.add_argument("--preset", default="cpu-default", choices=list(PRESETS), help="sweep (default: cpu-default)")
    r.add_argument("--archs", type=name_list, help=f"comma-separated architectures (default: all: {','.join(d.archs)})")
    r.add_argument("--seq-len", type=int, help=f"sequence length L (default: {d.seq_len})")
    r.add_argument("--kv-pairs", type=int_list, help=f"comma-separated key-value pair counts N, trained as one mix "
                                                     f"(default: {','.join(map(str, d.kv_pairs))})")
    r.add_argument("--held-out-kv-pairs", type=int_list, help=f"comma-separated N tested but never trained on, or '' for "
                                                             f"none (default: {','.join(map(str, d.held_out_kv_pairs))})")
    r.add_argument("--d-model", type=int_list, dest="d_models", help=f"comma-separated widths (default: {','.join(map(str, d.d_models))})")
    r.add_argument("--state-d-model", type=int_list, dest="state_d_models",
                   help=f"comma-separated widths also trained for the fixed-state architectures (linear attention, the "
                        f"SSMs), or '' for none (default: {','.join(map(str, d.state_d_models))})")
    r.add_argument("--lrs", type=float_list, help="comma-separated learning rates; the best is reported (default: each "
                                                  "architecture's own, `zoo describe ARCH` shows it)")
    r.add_argument("--vocab-size", type=int, help=f"vocabulary (default: {d.vocab_size})")
    r.add_argument("--train-examples", type=int, help=f"training examples per N (default: {d.train_examples})")
    r.add_argument("--test-examples", type=int, help=f"test examples per N (default: {d.test_examples})")
    r.add_argument("--min-steps", type=int, help=f"steps before a run may stop at a plateau (default: {d.min_steps})")
    r.add_argument("--max-steps", type=int, help=f"optimizer steps per run; stops early at accuracy > 0.99 on every "
                                                 f"trained N, or at a plateau after --min-steps (default: {d.max_steps})")
    r.add_argument("--batch-size", type=int, help=f"examples per step (default: {d.batch_size})")
    r.add_argument("--device", help=f"torch device, e.g. cpu or cuda (default: {d.device})")
    r.add_argument("--workers", type=int, help="runs trained at once, each in its own process (default: one per CPU "
                                               "core up to 2 on CPU; 1 on CUDA)")
    r.add_argument("--seeds", type=int_list, help=f"comma-separated seeds for training data, weights and shuffling; the "
                                                  f"report shows their mean and range (default: {','.join(map(str, d.seeds))})")
    add_moe_weight_options(r, d.moe_balance_weight, d.moe_z_weight)
    r.add_argument("--out", help=f"output folder (default: {d.out})")
    add_ray_option(r)
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_recall)


OPTION_FIELDS = ("archs", "seq_len", "kv_pairs", "held_out_kv_pairs", "d_models", "state_d_models", "lrs", "vocab_size",
                 "train_examples", "test_examples", "min_steps", "max_steps", "batch_size", "device", "workers", "seeds",
                 "ray", "moe_balance_weight", "moe_z_weight")


def cmd_recall(args) -> None:
    given = {name: getattr(args, name) for name in OPTION_FIELDS if getattr(args, name) is not None}
    out = Path(args.out) if args.out else RecallSettings().out
    sweeps = [RecallSettings(**{**preset, **given, "out": out}) for preset in PRESETS[args.preset]]
    for settings in sweeps:
        settings.validate()  # every sweep's settings checked before the first one trains
    rows = [row for settings in sweeps for row in run_recall(settings, show_progress=not args.quiet)]
    best = best_over_lr(rows)
    publish(out, markdown_table(best), lambda: write_report(best, out), sweeps)


def publish(out: Path, table: str, draw_charts, sweeps) -> None:
    """OUT/table.md and the charts written, then the table, the settings and the files named on the console."""
    write_atomic(out / "table.md", table)
    charts = draw_charts()
    print(table)
    print(f"settings: {[settings_dict(s) for s in sweeps]}")
    print(f"wrote {out / 'results.jsonl'}, {out / 'table.md'}, " + ", ".join(str(c) for c in charts))
