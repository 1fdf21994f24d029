"""`zoo convert`: a trained model turned into another architecture (zoo/convert.py), saved for `zoo distill
--student` to recover from the original."""
from pathlib import Path

import torch

import zoo
from harness.results import save_whole
from zoo.convert import TARGETS


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="turn a trained model into another architecture, started from its weights "
                                       "(fewer KV heads, a sliding window, Gated DeltaNet layers)",
                       description=__doc__ + " " + zoo.convert.__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--weights", required=True, help="a `zoo train` output folder or a `zoo.save` folder")
    p.add_argument("--to", required=True, choices=TARGETS, help="gqa: mean-pooled KV heads (--kv-heads); swa: a "
                                                                "sliding window (--window); gdn: Gated DeltaNet layers")
    p.add_argument("--kv-heads", type=int, help="gqa: KV heads a layer keeps")
    p.add_argument("--window", type=int, help="swa: tokens each query sees")
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
    torch.manual_seed(args.seed)
    converted = zoo.convert(model, args.to, kv_heads=args.kv_heads, window=args.window, layers=layers)
    out = save_whole(converted, Path(args.out))
    before, after = (zoo.parameter_counts(m).total for m in (model, converted))
    print(f"{model.config.name} -> {converted.config.name}: {before:,} -> {after:,} parameters, cache "
          f"{zoo.cache_bytes(model, 1024):,} -> {zoo.cache_bytes(converted, 1024):,} bytes a sequence at 1,024 "
          f"tokens; saved in {out}")
