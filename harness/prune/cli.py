"""`zoo prune`: cut a trained model to a parameter target by measured importance, and say what it cost.

WEIGHTS is a `zoo train` output folder (its newest checkpoint) or a `zoo.save` folder. Calibration windows come from
the corpus's training split (the one the model was trained on, or --corpus), the figures from its validation split.
OUT receives importance.json (the scores, reused by a re-run with the same calibration), model/ (the pruned model,
loadable with zoo.load), and prune.json (counts and validation bits per byte before and after). Each is written
whole, then renamed into place, so a killed run leaves either the file or nothing, and a re-run continues.
"""
import json
from pathlib import Path

import zoo
from zoo.pruning import PrunePlan
from harness.prune.importance import Importance, measure_importance
from harness.prune.plan import (BY, check_by, check_decode_target, decode_bytes, kv_heads_for_cache, plan_for_target,
                                resolve_target, target_for_decode)
from harness.results import save_whole, write_atomic
from harness.train.checkpoint import checkpoint_folder, read_train_state
from harness.train.corpus import check_window_fits, load_corpus, training_batch, validation_windows
from harness.train.objective import validation_bpb

CALIBRATION_SEED = 1234  # the calibration windows' draw: fixed, so a re-run scores the same text
EVAL_BATCH = 16


def add_parser(sub) -> None:
    p = sub.add_parser("prune", help="cut a trained model's layers, KV groups, FFN or embedding channels to a "
                                     "parameter target, "
                                     "by importance measured on calibration text (resumable)",
                       description=__doc__.split("\n\n")[0] + " " + __doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--weights", required=True, help="a `zoo train` output folder or a `zoo.save` folder")
    p.add_argument("--target", type=float, help="parameters to keep: a count (>= 1, e.g. 2e6) or a share of the "
                                                "model's (between 0 and 1); this or --decode-target")
    p.add_argument("--decode-target", type=float,
                   help="a share (between 0 and 1) of the bytes a batch-1 decode step reads, weights and the cache at "
                        "--decode-context tokens (the floor of a memory-bound step's time): the most parameters whose "
                        "plan reads no more")
    p.add_argument("--decode-context", type=int, default=1024, help="cached tokens of the decode step --decode-target "
                                                                     "prices (default: 1024)")
    p.add_argument("--by", default="mlp", choices=BY,
                   help="what is cut: FFN channels only, KV groups (and Gated DeltaNet heads) then channels, whole "
                        "layers then channels, embedding (d_model) channels only, or embedding then FFN channels "
                        "(default: mlp)")
    p.add_argument("--kv-heads", type=int, help="with --by heads+mlp: the KV groups every attention layer keeps "
                                                "(default: the target's share of them, rounded up)")
    p.add_argument("--cache-target", type=float, help="with --by heads+mlp: KV-cache bytes a token to stay within "
                                                      "(>= 1), or a share of the model's (between 0 and 1): every "
                                                      "attention layer keeps the most KV groups that fit")
    p.add_argument("--corpus", metavar="PATH", help="calibration and validation text (default: the corpus the model "
                                                    "was trained on, else this Python's standard library sources)")
    p.add_argument("--windows", type=int, default=64, help="calibration windows (default: 64)")
    p.add_argument("--context", type=int, default=256, help="bytes per window (default: 256)")
    p.add_argument("--eval-windows", type=int, default=64, help="validation windows for the figures (default: 64)")
    p.add_argument("--out", required=True, help="output folder (a re-run with the same --out continues)")
    p.set_defaults(func=cmd_prune)


def load_weights(weights: Path) -> tuple:
    """(model in float32, eval mode; the corpus a `zoo train` run trained it on, else None)."""
    folder = checkpoint_folder(weights)
    if folder is None:  # a zoo.save folder
        return zoo.load(weights).float().eval(), None
    return zoo.load(folder).float().eval(), read_train_state(weights)["settings"].get("corpus")


def write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=1))


def cmd_prune(args) -> None:
    for name in ("windows", "context", "eval_windows"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    weights, out = Path(args.weights), Path(args.out)
    try:  # everything checked before calibration runs
        model, trained_corpus = load_weights(weights)
        if (args.target is None) == (args.decode_target is None):
            raise ValueError("give one of --target (parameters) and --decode-target (a share of a decode step's bytes)")
        target = None if args.target is None else resolve_target(model, args.target)
        kv_heads = args.kv_heads
        if args.cache_target is not None:
            if args.kv_heads is not None or args.by != "heads+mlp":
                raise ValueError("--cache-target chooses --kv-heads, with --by heads+mlp: give one of the two, and "
                                 "--by heads+mlp")
            kv_heads = kv_heads_for_cache(model, args.cache_target)
        if target is None:
            check_decode_target(model, args.by, args.decode_target, args.decode_context, kv_heads)
        else:
            check_by(model, args.by, target, kv_heads)
        if args.context + 1 > model.config.max_seq_len:
            raise ValueError(f"--context {args.context} needs {args.context + 1} positions; the model holds "
                             f"{model.config.max_seq_len}")
        corpus = load_corpus(Path(args.corpus) if args.corpus else (Path(trained_corpus) if trained_corpus else None))
        check_window_fits(corpus, args.context + 1)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    calibration = {"weights": str(weights.resolve()), "windows": args.windows, "context": args.context,
                   "corpus": corpus.description, "seed": CALIBRATION_SEED}
    request = {"target": target, "decode_target": args.decode_target,
               "decode_context": None if args.decode_target is None else args.decode_context,
               "by": args.by, "kv_heads": kv_heads, "cache_target": args.cache_target,
               "eval_windows": args.eval_windows,
               "calibration": calibration}
    done = read_json(out / "prune.json")
    if done is not None and {k: done.get(k) for k in request} == request and (out / "model").is_dir():
        print(summary(done, out))  # this exact run finished before
        return
    out.mkdir(parents=True, exist_ok=True)
    cached = read_json(out / "importance.json")
    importance = None
    if cached is not None and cached.get("calibration") == calibration:
        importance = Importance.from_json(cached["importance"])
    if importance is None or importance.embedding is None or importance.state_heads is None:  # none, or older
        windows = training_batch(corpus, CALIBRATION_SEED, 0, args.windows, args.context)
        importance = measure_importance(model, windows)
        write_json(out / "importance.json", {"calibration": calibration, "importance": importance.to_json()})
    try:
        parameters = target if target is not None else target_for_decode(
            model, importance, args.decode_target, args.by, args.decode_context, kv_heads)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    plan = plan_for_target(model, importance, parameters, args.by, kv_heads)
    pruned = zoo.prune(model, plan)
    save_whole(pruned, out / "model")
    validation = validation_windows(corpus, args.eval_windows, args.context + 1)
    report = {**request, "parameter_target": parameters, "parameters_before": zoo.parameter_counts(model).total,
              "parameters_after": zoo.parameter_counts(pruned).total, "layers_kept": list(plan.layers),
              "kv_heads_kept": {str(i): len(h) for i, h in plan.kv_heads.items()},
              "channels_kept": {str(i): len(c) for i, c in plan.channels.items()},
              "state_heads_kept": {str(i): len(h) for i, h in plan.state_heads.items()},
              "embedding_kept": None if plan.embedding is None else len(plan.embedding),
              "cache_bytes_per_token_before": zoo.cache_bytes(model, 1), "cache_bytes_per_token_after":
                  zoo.cache_bytes(pruned, 1), "decode_weight_bytes_before": zoo.decode_weight_bytes(model),
              "decode_weight_bytes_after": zoo.decode_weight_bytes(pruned),
              "decode_step_bytes_before": decode_bytes(model, PrunePlan(tuple(range(model.config.n_layers))),
                                                       args.decode_context),
              "decode_step_bytes_after": decode_bytes(model, plan, args.decode_context),
              "bpb_before": validation_bpb(model, validation, EVAL_BATCH),
              "bpb_after": validation_bpb(pruned, validation, EVAL_BATCH)}
    write_json(out / "prune.json", report)
    print(summary(report, out))


def summary(report: dict, out: Path) -> str:
    cache = (f"; cache {report['cache_bytes_per_token_before']:,} -> {report['cache_bytes_per_token_after']:,} "
             f"bytes a token" if "cache_bytes_per_token_after" in report else "")
    decode = (f"; a decode step reads {report['decode_step_bytes_before']:,} -> {report['decode_step_bytes_after']:,} "
              f"bytes" if "decode_step_bytes_after" in report else "")
    target = (f"{report['target']:,}" if report.get("target") is not None else
              f"{report['parameter_target']:,}, for {report['decode_target']:.0%} of the decode step's bytes")
    return (f"{report['parameters_before']:,} -> {report['parameters_after']:,} parameters (target "
            f"{target}, by {report['by']}){cache}{decode}; validation bits per byte {report['bpb_before']:.4f} "
            f"-> {report['bpb_after']:.4f}; model in {out / 'model'}")


def read_json(path: Path) -> dict | None:
    """A results file an earlier run wrote whole, or None (absent, or not JSON)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
