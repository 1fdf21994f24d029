"""`zoo train` from the command line: its options, registry overrides as --set KEY=VALUE, the summary line."""
import argparse
from pathlib import Path

import zoo
from harness.train.settings import AUTOCAST, TrainSettings
from harness.train.trainer import run_train, summary_line


def override(text: str) -> tuple[str, object]:
    """KEY=VALUE, the value read as an integer, else a number, else true/false, else text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (a registry setting, e.g. window=32), got {text!r}")
    for parse in (int, float):
        try:
            return key.strip(), parse(value)
        except ValueError:
            pass
    return key.strip(), {"true": True, "false": False}.get(value.lower(), value)


def optional_number(unit: str):
    """An argparse type: a number of `unit`, or 'none' (no such limit)."""

    def parse(text: str) -> float | None:
        if text.lower() == "none":
            return None
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {unit} or 'none', got {text!r}") from None

    return parse


def add_moe_weight_options(parser, balance_weight: float, z_weight: float) -> None:
    """--moe-balance-weight and --moe-z-weight, as zoo train and zoo recall take them."""
    parser.add_argument("--moe-balance-weight", type=float, default=balance_weight, metavar="W",
                        help="weight of the Switch Transformer load-balancing loss added to the training loss of a "
                             "model with MoE layers; 0 turns it off, a model without MoE layers ignores it "
                             f"(default: {balance_weight:g})")
    parser.add_argument("--moe-z-weight", type=float, default=z_weight, metavar="W",
                        help=f"weight of the ST-MoE router z-loss, likewise (default: {z_weight:g})")


def add_parser(sub) -> None:
    t = sub.add_parser("train", help="train an architecture as a byte-level LM on local text (resumable; validation "
                                     "bits per byte beside a unigram baseline)",
                       description="Train any registry architecture (hybrids via --set) as a byte-level causal LM, "
                                   "or a masked diffusion LM with its own objective, on a local corpus: by default "
                                   "this Python's standard library .py sources, split by file (5% validation). "
                                   "Checkpoints (OUT/checkpoint, loadable with zoo.load) and a results.jsonl row at "
                                   "every evaluation; the same command with the same --out continues from the "
                                   "newest checkpoint.")
    d = TrainSettings()
    t.add_argument("--arch", default=d.arch, help=f"architecture (default: {d.arch}; see `zoo list`)")
    t.add_argument("--preset", default=d.preset, choices=list(zoo.PRESETS), help=f"model size (default: {d.preset})")
    t.add_argument("--set", dest="overrides", type=override, action="append", default=[], metavar="KEY=VALUE",
                   help="a registry setting (`zoo describe ARCH`), repeatable, e.g. --set layers=swa,gqa --set "
                        "window=32; the value is read as an integer, else a number, else true/false, else text "
                        "(default: none)")
    t.add_argument("--corpus", metavar="PATH", help="a text file (its last 5%% is validation) or a folder of files (split by file) "
                                    "(default: this Python's standard library .py sources)")
    t.add_argument("--context", type=int, default=d.context, help=f"bytes per training window (default: {d.context})")
    t.add_argument("--batch-size", type=int, default=d.batch_size, help=f"windows per step (default: {d.batch_size})")
    t.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate, after warmup; cosine decay to 10%% "
                                                          f"of it (default: {d.lr:g})")
    t.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help=f"linear warmup steps (default: {d.warmup_steps})")
    t.add_argument("--minutes", type=optional_number("minutes"), default=d.minutes, help=f"training-time budget in minutes, "
                   f"evaluations not counted; 'none': steps only (default: {d.minutes:g})")
    t.add_argument("--max-steps", type=int, help="step budget; training stops at whichever budget ends first "
                                                 "(default: none)")
    t.add_argument("--eval-every", type=int, default=d.eval_every, help=f"steps between validation figures and "
                                                                        f"checkpoints (default: {d.eval_every})")
    t.add_argument("--eval-windows", type=int, default=d.eval_windows, help=f"fixed validation windows of context + 1 "
                                                                            f"bytes (default: {d.eval_windows})")
    t.add_argument("--autocast", default=d.autocast, choices=list(AUTOCAST), help="bf16 autocast: auto = on for CUDA, and on "
                   "CPUs with bf16 kernels (AVX-512, AMX) for models of d_model >= 512, where it measured 1.6x faster "
                   f"(default: {d.autocast})")
    t.add_argument("--device", default=d.device, help=f"torch device, e.g. cpu or cuda (default: {d.device})")
    t.add_argument("--seed", type=int, default=d.seed, help=f"seed for weights, batches and masking (default: {d.seed})")
    add_moe_weight_options(t, d.moe_balance_weight, d.moe_z_weight)
    t.add_argument("--out", help="output folder; an existing checkpoint there is continued (default: "
                                 "results/train/ARCH-PRESET)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)


def cmd_train(args) -> None:
    settings = TrainSettings(arch=args.arch, preset=args.preset, overrides=dict(args.overrides),
                             corpus=Path(args.corpus) if args.corpus else None, context=args.context,
                             batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                             minutes=args.minutes, max_steps=args.max_steps, eval_every=args.eval_every,
                             eval_windows=args.eval_windows, autocast=args.autocast, device=args.device,
                             seed=args.seed, moe_balance_weight=args.moe_balance_weight,
                             moe_z_weight=args.moe_z_weight, out=Path(args.out) if args.out else None)
    print(summary_line(run_train(settings, show_progress=not args.quiet)))
