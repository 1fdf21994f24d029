"""`zoo convert`: a trained model turned into another architecture (zoo/convert.py), saved for `zoo distill
--student` to recover from the original."""
from pathlib import Path

import torch

import zoo
from harness.prune.cli import CALIBRATION_SEED
from harness.results import save_whole
from harness.train.corpus import check_window_fits, load_corpus, training_batch
from zoo.convert import TARGETS


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="turn a trained model into another architecture, started from its weights "
                                       "(fewer KV heads, a sliding window, Gated DeltaNet or MLA layers)",
                       description=__doc__ + " " + zoo.convert.__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--weights", required=True, help="a `zoo train` output folder or a `zoo.save` folder")
    p.add_argument("--to", required=True, choices=TARGETS,
                   help="gqa: mean-pooled KV heads (--kv-heads); swa: a sliding window (--window); gdn: Gated "
                        "DeltaNet layers; mla: latent attention (--kv-rank, --rope-dim)")
    p.add_argument("--kv-heads", type=int, help="gqa: KV heads a layer keeps")
    p.add_argument("--window", type=int, help="swa: tokens each query sees")
    p.add_argument("--kv-rank", type=int, help="mla: latent channels a token caches besides the rope key (default: "
                                               "half the layer's KV cache, less the rope key)")
    p.add_argument("--rope-dim", type=int, help="mla: rotated channels of a query and the shared key, an even divisor "
                                                "of head_dim (default: half a head)")
    p.add_argument("--corpus", metavar="PATH", help="mla: calibration text the latent is fitted on (default: this "
                                                    "Python's standard library sources)")
    p.add_argument("--windows", type=int, default=64, help="mla: calibration windows (default: 64)")
    p.add_argument("--context", type=int, default=256, help="mla: bytes per calibration window (default: 256)")
    p.add_argument("--layers", help="comma-separated layer indices to convert (default: every attention layer that "
                                    "computes its own keys and values)")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights with no counterpart (gdn's gates and "
                                                       "decays) (default: 0)")
    p.add_argument("--out", required=True, help="output folder (a zoo.save folder; replaced whole)")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args) -> None:
    try:
        layers = None if args.layers is None else [int(i) for i in args.layers.split(",")]
    except ValueError:
        raise SystemExit(f"--layers must be comma-separated integers, got {args.layers!r}") from None
    model = zoo.load(args.weights).float()
    calibration = None
    if args.to == "mla":
        if args.windows < 1 or not 1 <= args.context <= model.config.max_seq_len:
            raise SystemExit(f"--windows must be >= 1 and --context between 1 and the model's "
                             f"{model.config.max_seq_len} positions, got {args.windows} and {args.context}")
        corpus = load_corpus(Path(args.corpus) if args.corpus else None)
        check_window_fits(corpus, args.context)
        calibration = training_batch(corpus, CALIBRATION_SEED, 0, args.windows, args.context)
    torch.manual_seed(args.seed)
    converted = zoo.convert(model, args.to, kv_heads=args.kv_heads, window=args.window, layers=layers,
                            kv_rank=args.kv_rank, rope_dim=args.rope_dim, calibration=calibration)
    out = save_whole(converted, Path(args.out))
    before, after = (zoo.parameter_counts(m).total for m in (model, converted))
    print(f"{model.config.name} -> {converted.config.name}: {before:,} -> {after:,} parameters, cache "
          f"{zoo.cache_bytes(model, 1024):,} -> {zoo.cache_bytes(converted, 1024):,} bytes a sequence at 1,024 "
          f"tokens; saved in {out}")
