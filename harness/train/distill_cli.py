"""`zoo distill`: train a saved student (a `zoo prune` output, or any `zoo.save` folder) on the corpus while it
learns a teacher's next-byte distributions, as `zoo train` trains (the same schedule, checkpoints and resume).
With --scratch the student's architecture starts from random weights and learns from the bytes alone: the
from-scratch twin a distilled student is measured against, for the same tokens."""
from pathlib import Path

import zoo
from harness.train.cli import optional_number
from harness.train.settings import AUTOCAST, TrainSettings
from harness.train.trainer import run_train, summary_line

DEFAULTS = TrainSettings(lr=3e-3, minutes=5.0, eval_every=100, eval_windows=64)  # a student starts trained: a lower lr


def add_parser(sub) -> None:
    p = sub.add_parser("distill", help="train a saved student (e.g. a pruned model) from a teacher's next-byte "
                                       "distributions plus the bytes (resumable)", description=__doc__)
    p.add_argument("--teacher", help="the teacher: a `zoo train` output folder or a `zoo.save` folder (needed "
                                     "unless --scratch)")
    p.add_argument("--student", required=True, help="the student: a `zoo.save` folder (e.g. `zoo prune`'s OUT/model)")
    p.add_argument("--scratch", action="store_true", help="the student's architecture from random weights, on the "
                                                          "bytes alone (no teacher): the from-scratch twin")
    p.add_argument("--temperature", type=float, default=DEFAULTS.distill_temperature,
                   help=f"softens both distributions; the KL term is scaled by its square (default: "
                        f"{DEFAULTS.distill_temperature:g})")
    p.add_argument("--kl-weight", type=float, default=DEFAULTS.distill_weight,
                   help=f"the loss is (1 - w) x cross-entropy + w x T^2 x KL(teacher || student) (default: "
                        f"{DEFAULTS.distill_weight:g})")
    p.add_argument("--corpus", metavar="PATH", help="a text file or folder (default: this Python's standard library "
                                                    "sources)")
    p.add_argument("--context", type=int, default=DEFAULTS.context, help=f"bytes per window (default: "
                                                                         f"{DEFAULTS.context})")
    p.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size, help=f"windows per step (default: "
                                                                               f"{DEFAULTS.batch_size})")
    p.add_argument("--lr", type=float, default=DEFAULTS.lr, help=f"peak learning rate (default: {DEFAULTS.lr:g})")
    p.add_argument("--warmup-steps", type=int, default=DEFAULTS.warmup_steps,
                   help=f"linear warmup steps (default: {DEFAULTS.warmup_steps})")
    p.add_argument("--minutes", type=optional_number("minutes"), default=DEFAULTS.minutes,
                   help=f"training-time budget in minutes; 'none': steps only (default: {DEFAULTS.minutes:g})")
    p.add_argument("--max-steps", type=int, help="step budget (default: none)")
    p.add_argument("--eval-every", type=int, default=DEFAULTS.eval_every,
                   help=f"steps between validation figures and checkpoints (default: {DEFAULTS.eval_every})")
    p.add_argument("--eval-windows", type=int, default=DEFAULTS.eval_windows,
                   help=f"fixed validation windows (default: {DEFAULTS.eval_windows})")
    p.add_argument("--autocast", default=DEFAULTS.autocast, choices=list(AUTOCAST), help="bf16 autocast, as zoo "
                                                                                         "train's (default: auto)")
    p.add_argument("--device", default=DEFAULTS.device, help="torch device (default: cpu)")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help="seed for batches (and --scratch's weights)")
    p.add_argument("--out", required=True, help="output folder; an existing checkpoint there is continued")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_distill)


def distill_settings(args) -> TrainSettings:
    student = Path(args.student)
    if args.teacher is None and not args.scratch:
        raise SystemExit("--teacher is needed (a student learns from it), unless --scratch trains the student's "
                         "architecture from random weights alone")
    try:
        name = zoo.checkpoint.load_config(student).name
    except ValueError as error:
        raise SystemExit(f"--student {student}: {error}") from None
    return TrainSettings(
        arch=name, preset="saved", init=student, init_weights=not args.scratch,
        teacher=None if args.scratch else Path(args.teacher), distill_temperature=args.temperature,
        distill_weight=args.kl_weight, corpus=Path(args.corpus) if args.corpus else None, context=args.context,
        batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps, minutes=args.minutes,
        max_steps=args.max_steps, eval_every=args.eval_every, eval_windows=args.eval_windows, autocast=args.autocast,
        device=args.device, seed=args.seed, out=Path(args.out))


def cmd_distill(args) -> None:
    print(summary_line(run_train(distill_settings(args), show_progress=not args.quiet)))
