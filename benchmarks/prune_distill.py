"""Pruning, then distillation, against the same architecture trained from scratch (Minitron's comparison,
Muralidharan et al. 2024), on a `zoo train` gqa teacher:

1. teacher: `zoo train --arch gqa --preset PRESET` for --teacher-steps steps (OUT/teacher);
2. pruned: `zoo prune` to --share of its parameters, by each of --by: FFN channels (mlp), whole layers then
   channels (depth+mlp), embedding then FFN channels (embedding+mlp) (OUT/prune-BY);
3. distilled: `zoo distill` of each pruned model from the teacher for --steps steps (OUT/distill-BY);
4. scratch: the pruned architecture from random weights on the bytes alone for the same steps, at zoo train's
   learning rate (OUT/scratch-BY): the same tokens as the distillation; and finetuned: the pruned model on the
   bytes alone for the same steps at the distillation's rate (OUT/finetune-BY), what the teacher adds;
5. conversions (--conversions): the teacher turned into another architecture by `zoo.convert` ("mqa": one KV head a
   layer, mean-pooled; "hybrid-gdn": every other layer Gated DeltaNet; "mla": latent attention with the cache of
   mqa's, a whitened SVD fitted on the prune calibration windows), each distilled, finetuned and with its
   scratch twin, as the pruned ones (OUT/convert-NAME, distill-NAME, finetune-NAME, scratch-NAME).

Then each model's validation bits per byte (the same fixed windows for all), parameters, cache bytes a token and
decode step time (batch --batch at context --context, caches filled as if prefilled; run alone) go to
OUT/results.jsonl, its copy recall (bits per byte on the second copy of a validation span of --context / 2 bytes,
harness/copy_recall.py) to OUT/recall.jsonl, and the chart (quality against decode time, a line a method) to OUT/quality_vs_decode.png.
Every stage continues from what an earlier run left.

    python benchmarks/prune_distill.py --preset small --teacher-steps 600 --steps 200
"""
import argparse
from pathlib import Path

import torch

import zoo
from harness import cli
from harness.charts import line_chart
from harness.copy_recall import copy_bpb
from harness.decode_probe import decode_probe
from harness.prune.cli import CALIBRATION_SEED
from harness.results import ResultStore, save_whole
from harness.train import TrainSettings, load_corpus, run_train, validation_windows
from harness.train.corpus import training_batch
from harness.train.objective import validation_bpb

BY = ("mlp", "depth+mlp", "embedding+mlp")
CONVERSIONS = {"mqa": {"to": "gqa", "kv_heads": 1},
               "hybrid-gdn": {"to": "gdn", "layers": "odd"},  # odd: layers 1, 3, 5, ...
               "mla": {"to": "mla"}}  # default sizes: latent + rope key half the GQA cache, as mqa's
SCRATCH_LR = TrainSettings().lr  # zoo train's: a model from random weights needs it; a trained student does not
DISTILL_LR = 3e-3  # zoo distill's default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--teacher-steps", type=int, default=600)
    parser.add_argument("--share", type=float, default=0.5, help="parameters kept")
    parser.add_argument("--steps", type=int, default=200, help="distillation (and scratch) steps")
    parser.add_argument("--batch", type=int, default=1, help="decode batch")
    parser.add_argument("--context", type=int, default=256, help="decode context and training window")
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--by", default=",".join(BY), help=f"comma-separated `zoo prune --by` axes (default: "
                        f"{','.join(BY)})")
    parser.add_argument("--conversions", default=",".join(CONVERSIONS), help=f"comma-separated, of {list(CONVERSIONS)}, "
                        "or none")
    parser.add_argument("--out", type=Path, default=Path("results/prune_distill"))
    args = parser.parse_args()
    out = args.out
    steps = {"max_steps": args.steps, "minutes": None, "eval_every": max(1, args.steps // 4), "eval_windows": 64,
             "context": args.context}
    teacher = run_train(TrainSettings(arch="gqa", preset=args.preset, max_steps=args.teacher_steps, minutes=None,
                                      context=args.context, out=out / "teacher"), show_progress=False)
    print("teacher", teacher["val_bpb"], flush=True)
    models = {"teacher": out / "teacher" / "checkpoint"}
    for by in args.by.split(","):
        name = by.replace("+", "-")
        cli.main(["prune", "--weights", str(out / "teacher"), "--target", str(args.share), "--by", by,
                  "--context", str(args.context), "--out", str(out / f"prune-{name}")])
        student = out / f"prune-{name}" / "model"
        models.update({f"pruned {by}": student,
                       **distilled_and_twin(out, name, by, f"gqa-pruned-{name}", student, steps)})
    for name in filter(lambda n: n != "none", args.conversions.split(",")):
        student = converted(out, name)
        models.update({f"converted {name}": student,
                       **distilled_and_twin(out, name, name, f"gqa-to-{name}", student, steps)})
    measure(models, args, out)


def distilled_and_twin(out: Path, name: str, label: str, arch: str, student: Path, steps: dict) -> dict[str, Path]:
    """The student distilled from the teacher, the student on the bytes alone, and its architecture from random
    weights on the bytes alone, for the same steps (runs named `arch`, in OUT/distill-NAME, OUT/finetune-NAME and
    OUT/scratch-NAME): {"distilled LABEL": checkpoint, "finetuned LABEL": ..., "scratch LABEL": ...}."""
    run_train(TrainSettings(arch=arch, preset="saved", init=student, teacher=out / "teacher", lr=DISTILL_LR,
                            out=out / f"distill-{name}", **steps), show_progress=False)
    run_train(TrainSettings(arch=arch, preset="saved", init=student, init_weights=False, lr=SCRATCH_LR,
                            out=out / f"scratch-{name}", **steps), show_progress=False)
    run_train(TrainSettings(arch=arch, preset="saved", init=student, lr=DISTILL_LR, out=out / f"finetune-{name}",
                            **steps), show_progress=False)
    return {f"distilled {label}": out / f"distill-{name}" / "checkpoint",
            f"finetuned {label}": out / f"finetune-{name}" / "checkpoint",
            f"scratch {label}": out / f"scratch-{name}" / "checkpoint"}


def converted(out: Path, name: str) -> Path:
    """The teacher converted and saved (once): OUT/convert-NAME."""
    if name not in CONVERSIONS:
        raise SystemExit(f"unknown conversion {name!r}; allowed: {', '.join(CONVERSIONS)}, none")
    folder = out / f"convert-{name}"
    if not folder.exists():
        teacher = zoo.load(out / "teacher" / "checkpoint").float()
        options = dict(CONVERSIONS[name])
        if options.get("layers") == "odd":
            options["layers"] = list(range(1, teacher.config.n_layers, 2))
        if options["to"] == "mla":
            options["calibration"] = training_batch(load_corpus(None), CALIBRATION_SEED, 0, 64, 256)
        torch.manual_seed(0)
        save_whole(zoo.convert(teacher, **options), folder)
    return folder


def measure(models: dict[str, Path], args, out: Path) -> None:
    store = ResultStore(out / "results.jsonl", ("model", "steps", "teacher_steps", "share", "batch", "context"))
    windows = validation_windows(load_corpus(None), args.eval_windows, args.context + 1)
    for name, folder in models.items():
        cell = {"model": name, "steps": args.steps, "teacher_steps": args.teacher_steps, "share": args.share,
                "batch": args.batch, "context": args.context}
        if store.done(cell):
            continue
        model = zoo.load(folder).float().eval()
        bpb = validation_bpb(model, windows, 16)
        step = decode_probe(model.to(torch.bfloat16), args.batch, args.context).median_step()
        store.append({**cell, "bpb": bpb, "parameters": zoo.parameter_counts(model).total,
                      "cache_bytes": zoo.cache_bytes(model, args.context, dtype=torch.bfloat16),
                      "decode_ms": 1000 * step})
        print(name, {k: v for k, v in store.rows[-1].items() if k not in cell}, flush=True)
    recall = copy_recall(models, args, out)
    rows = [r for r in store.rows if r["steps"] == args.steps and r["teacher_steps"] == args.teacher_steps]
    series = {kind: tuple(zip(*sorted((r["decode_ms"], r["bpb"]) for r in rows if r["model"].startswith(kind))))
              for kind in ("pruned", "converted", "distilled", "finetuned", "scratch")
              if any(r["model"].startswith(kind) for r in rows)}
    teacher = next(r for r in rows if r["model"] == "teacher")
    series["teacher"] = ([teacher["decode_ms"]], [teacher["bpb"]])
    line_chart(out / "quality_vs_decode.png", f"gqa {args.preset} pruned to {args.share:.0%}, {args.steps} steps",
               f"decode step (ms, batch {args.batch}, context {args.context}, bf16)", "validation bits per byte",
               series, logx=False)
    print(f"| model | parameters | bits per byte | copy recall (bpb) | decode step (ms) | cache at {args.context} "
          "tokens (bf16) |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['parameters']:,} | {r['bpb']:.3f} | {recall[r['model']]:.3f} | "
              f"{r['decode_ms']:.2f} | {r['cache_bytes']:,} B |")


def copy_recall(models: dict[str, Path], args, out: Path) -> dict[str, float]:
    """{model: bits per byte on the second copy of --eval-windows validation spans of --context / 2 bytes}."""
    store = ResultStore(out / "recall.jsonl", ("model", "steps", "teacher_steps", "share", "span"))
    spans = validation_windows(load_corpus(None), args.eval_windows, args.context // 2)
    for name, folder in models.items():
        cell = {"model": name, "steps": args.steps, "teacher_steps": args.teacher_steps, "share": args.share,
                "span": args.context // 2}
        if not store.done(cell):
            store.append({**cell, "copy_bpb": copy_bpb(zoo.load(folder).float(), spans)})
    return {r["model"]: r["copy_bpb"] for r in store.rows if all(r[k] == v for k, v in cell.items() if k != "model")}


if __name__ == "__main__":
    main()
