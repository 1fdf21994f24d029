"""What weight quantization costs in quality, per architecture: int8, int4 round-to-nearest and int4 activation-aware
(AWQ, calibrated as harness/quant_calibration.py does: scales from 64 x 256 bytes of training-split windows, 16k
tokens, judged by greedy agreement on 256 training-split prompts), against the same model unquantized.

- Language models (`zoo train` folders, one per architecture): validation bits per byte on the fixed validation
  windows, the KL divergence of its next-byte distributions from the unquantized model's there (bits per byte), and
  greedy agreement over 256 tokens from 2048 held-out prompts (the share of positions where the quantized
  model's token equals the unquantized one's, and the mean position of the first difference); AWQ against RTN also
  prompt by prompt: the mean difference of their agreements and its standard error, clustered by the file each
  prompt comes from (prompts of one file move together: the validation split is 86 files, and a random window lands
  in pydoc_data/topics.py, its English help text, 42% of the time); and the difference within the most drawn file
  and over the rest.
- KV-cache quantization (int8, fp8 e4m3; the weights unquantized), for the language models with a per-token cache:
  decode reads the cache, so each is run through the engine against the float cache: greedy agreement as above,
  and the KL of the next-byte distributions at the positions before a prompt's first difference, where both runs
  have seen the same text (bits per byte).
- Associative recall (Zoology's MQAR at L 64, d_model 64), each architecture trained here as `zoo recall` trains
  it: N = 4 and 8 key-value pairs mixed, 32,000 examples each, its registry learning rate, until solved (0.99), at a
  plateau, or --recall-steps. Scored quantized on the same 2,000 test examples per N: the trained N (4 and 8, 24,000
  queries) and the held-out N = 16 (32,000 queries). AWQ's scales come from 256 training examples and its
  candidates are judged by their accuracy on 8,000 freshly drawn examples of the trained N (neither test nor
  training examples). AWQ against RTN is also a paired count: the queries only one of them answers, with McNemar's
  exact two-sided p (could the split be chance?).

Rows go to OUT/results.jsonl atomically as they finish; a re-run skips them.

    python benchmarks/quant_quality.py --lm-dir runs/lm/tiny --archs gqa,mla,mamba,hybrid-1in6
"""
import argparse
import dataclasses
import statistics
from pathlib import Path

import torch

import zoo
from harness import Engine, SamplingParams
from harness.recall.data import MQARSetting, make_splits
from harness.recall.suite import RecallSettings, make_data, train_config
from harness.recall.train import RECIPE_LAYERS, evaluate, labelled_logits, train_recall
from harness.quant_calibration import Calibration, awq_quantize, greedy_tokens
from harness.results import ResultStore
from harness.paired_stats import mcnemar_p, paired_difference
from harness.train.corpus import load_corpus, training_starts, validation_starts, validation_windows, windows_at
from harness.train.objective import validation_bpb
from harness.train.checkpoint import read_train_state

VARIANTS = {"int8": zoo.QuantizeConfig("int8"), "int4 rtn": zoo.QuantizeConfig("int4", group_size=32),
            "int4 awq": zoo.QuantizeConfig("int4", group_size=32, method="awq")}
KEY = ("task", "arch", "variant")
TRAINING_PROMPT_SEED = 7  # --agreement-prompts training: not Calibration's seed, so not the prompts AWQ judged by


def agreement(model, quantized, prompts: list[list[int]], new_tokens: int) -> dict[str, list[float]]:
    """Per prompt, over greedy runs: the share of equal tokens position by position ("agreement") and the position
    of the first difference ("first_difference"; new_tokens where there is none)."""
    runs = [greedy_tokens(m, prompts, new_tokens) for m in (model, quantized)]
    return {"agreement": [sum(a == b for a, b in zip(x, y)) / new_tokens for x, y in zip(*runs)],
            "first_difference": [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), new_tokens)
                                 for x, y in zip(*runs)]}


def agreement_prompts(corpus, args) -> tuple[list[list[int]], list[str]]:
    """The prompts greedy agreement runs from and the file each starts in: held-out validation windows, or
    (--agreement-prompts training) training-split windows of another seed than AWQ's calibration prompts, to tell a
    split's text from the rest."""
    if args.agreement_prompts == "training":
        side, data = "train", corpus.train
        starts = training_starts(corpus, TRAINING_PROMPT_SEED, 1, args.prompts, args.prompt_len)
    else:
        side, data = "validation", corpus.validation
        starts = validation_starts(corpus, args.prompts, args.prompt_len)
    names = corpus.file_names[side]
    return windows_at(data, starts, args.prompt_len).tolist(), [names[i] for i in corpus.files_at(side, starts)]


def awq_against_rtn(awq: dict[str, list[float]], rtn: dict[str, list[float]], files: list[str]) -> dict:
    """AWQ's per-prompt measures against RTN's (agreement(), same prompts): each mean difference with its
    file-clustered (prompt by prompt where all come from one file) and its per-prompt standard error, and the
    difference within the file most prompts come from and over the others."""
    clusters = files if len(set(files)) > 1 else None  # a single-file corpus: one cluster has no error of its own
    top = max(set(files), key=files.count)
    inside = [i for i, f in enumerate(files) if f == top]
    outside = [i for i, f in enumerate(files) if f != top]
    row = {"agreement_files": len(set(files)), "top_file": top, "top_file_prompts": len(inside)}
    for measure in awq:
        a, b = awq[measure], rtn[measure]
        difference, error = paired_difference(a, b, clusters)
        row.update({f"{measure}_vs_rtn": difference, f"{measure}_vs_rtn_se": error,
                    f"{measure}_vs_rtn_se_prompts": paired_difference(a, b)[1]})
        for part, index in (("top_file", inside), ("other_files", outside)):
            if len(index) >= 2 and (part == "top_file" or len({files[i] for i in index}) >= 2):
                d, e = paired_difference([a[i] for i in index], [b[i] for i in index],
                                         None if part == "top_file" else [files[i] for i in index])
                row.update({f"{measure}_vs_rtn_{part}": d, f"{measure}_vs_rtn_{part}_se": e})
    return row


@torch.no_grad()
def divergence(model, quantized, windows: torch.Tensor) -> float:
    """Mean KL(unquantized || quantized) of the next-byte distributions over the validation windows, in bits."""
    total = 0.0
    for chunk in windows.split(32):
        want, got = (m(chunk[:, :-1]).float().log_softmax(-1) for m in (model, quantized))
        total += float((want.exp() * (want - got)).sum(-1).mean()) * len(chunk)
    return total / len(windows) / torch.log(torch.tensor(2.0)).item()


def lm_rows(arch: str, folder: Path, args) -> list[dict]:
    model = zoo.load(folder)
    state = read_train_state(folder)
    corpus = load_corpus(Path(state["settings"]["corpus"]) if state["settings"]["corpus"] else None)
    context = state["settings"]["context"]
    windows = validation_windows(corpus, 256, context + 1)
    calibration = Calibration(windows=args.calibration_windows, prompts=args.calibration_prompts)
    prompts, files = agreement_prompts(corpus, args)
    base = validation_bpb(model, windows, 32)
    rows = [{"task": "lm", "arch": arch, "variant": "none", "val_bpb": base, "weight_bytes": zoo.parameter_bytes(model)}]
    per_prompt = {}
    for name, config in VARIANTS.items():
        quantized = (awq_quantize(model, config, state["settings"]["corpus"], calibration) if config.method == "awq"
                     else zoo.quantize(model, config))
        per_prompt[name] = agreement(model, quantized, prompts, args.new_tokens)
        bpb = validation_bpb(quantized, windows, 32)
        rows.append({"task": "lm", "arch": arch, "variant": name, "val_bpb": bpb, "bpb_delta": bpb - base,
                     "kl_bits": divergence(model, quantized, windows),
                     **{measure: statistics.mean(values) for measure, values in per_prompt[name].items()},
                     "weight_bytes": zoo.parameter_bytes(quantized)})
    rows[-1].update(awq_against_rtn(per_prompt["int4 awq"], per_prompt["int4 rtn"], files))
    return rows


def kv_rows(arch: str, folder: Path, args) -> list[dict]:
    model = zoo.load(folder)
    if not any(spec.elements_per_token for spec in model.cache_specs()):
        return []  # recurrent state only: it stays in its declared dtype
    state = read_train_state(folder)
    corpus = load_corpus(Path(state["settings"]["corpus"]) if state["settings"]["corpus"] else None)
    prompts = validation_windows(corpus, args.prompts, args.prompt_len).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, return_logits=True)
    runs = {kv: Engine(model, max_batch=len(prompts), max_seq_len=len(prompts[0]) + args.new_tokens,
                       kv_dtype=kv).generate(prompts, params) for kv in ("auto", "int8", "fp8")}
    rows = []
    for kv in ("int8", "fp8"):
        same = shared = 0
        firsts, kl = [], 0.0
        for exact, rounded in zip(runs["auto"], runs[kv]):
            pairs = list(zip(exact.token_ids, rounded.token_ids))
            same += sum(a == b for a, b in pairs)
            first = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
            firsts.append(first)
            # position `first` itself was sampled from the same context too
            last = min(first + 1, len(pairs))
            want, got = (torch.stack(r.logits[:last]).float().log_softmax(-1) for r in (exact, rounded))
            kl += float((want.exp() * (want - got)).sum()) / torch.log(torch.tensor(2.0)).item()
            shared += last
        rows.append({"task": "kv", "arch": arch, "variant": kv, "agreement": same / (len(prompts) * args.new_tokens),
                     "first_difference": sum(firsts) / len(firsts), "kl_bits": kl / shared,
                     "cache_bytes_per_token": zoo.cache_bytes(model, 1, kv_format=kv)})
    return rows


@torch.no_grad()
def query_hits(model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Whether the model's argmax answers each query of the test set, in order: bool [queries]."""
    hits = []
    for start in range(0, len(inputs), 256):
        logits, targets, _ = labelled_logits(model.eval(), inputs[start:start + 256], labels[start:start + 256])
        hits.append(logits.argmax(-1) == targets)
    return torch.cat(hits)


def recall_rows(arch: str, args) -> list[dict]:
    # zoo recall's data and recipe (N = 4 and 8 mixed, 32,000 examples each, stopped when solved or at a plateau), so
    # the model quantized here is the one the recall table reports; tested on the trained N and the held-out N = 16
    settings = RecallSettings(test_examples=args.recall_test_examples, max_steps=args.recall_steps)
    train, tests = make_data(settings, seed=0)
    config = train_config({"arch": arch, "n_layers": RECIPE_LAYERS, "d_model": 64, "lr": zoo.registry.recall_lr(arch),
                           "seed": 0}, settings)
    if arch == "hybrid":  # a 2-layer mamba + gqa model, the hybrid-1in6 language model's two mixers
        config = dataclasses.replace(config, overrides={"layers": "mamba,gqa"})
    trained = train_recall(config, train, tests, keep_model=True)
    model = trained["model"]
    seen = config.trained_sets
    # AWQ's scales from the first training examples; its candidates judged on freshly drawn ones of the trained N
    # (another seed: neither the test sets nor training examples, which a model may partly memorise)
    calibration = train[0][:args.calibration_examples]
    judges = make_splits([], [(MQARSetting(settings.seq_len, n, settings.vocab_size),
                               args.judge_examples // len(settings.kv_pairs)) for n in settings.kv_pairs],
                         seed=0, test_seed_base=1)[1]

    def judged(m) -> float:
        return statistics.mean(evaluate(m, x, y)["accuracy"] for x, y in judges)

    rows, hits = [], {}
    for name, quant in {"none": None, **VARIANTS}.items():
        quantized = (model if quant is None else zoo.quantize(model, quant, calibration, score=judged)
                     if quant.method == "awq" else zoo.quantize(model, quant))
        hits[name] = {test: query_hits(quantized, *tests[test]) for test in tests}
        per_n = {test: evaluate(quantized, *tests[test])["accuracy"] for test in tests}
        rows.append({"task": "mqar", "arch": arch, "variant": name, "steps": trained["steps"],
                     "accuracy": statistics.mean(per_n[test] for test in seen),
                     "held_out_accuracy": statistics.mean(per_n[test] for test in tests if test not in seen),
                     "per_setting": per_n})
    for row in rows[1:]:
        row.update(accuracy_delta=row["accuracy"] - rows[0]["accuracy"],
                   held_out_delta=row["held_out_accuracy"] - rows[0]["held_out_accuracy"])
    for group, names in (("", seen), ("held_out_", [test for test in tests if test not in seen])):
        awq, rtn = (torch.cat([hits[variant][test] for test in names]) for variant in ("int4 awq", "int4 rtn"))
        awq_only, rtn_only = int((awq & ~rtn).sum()), int((rtn & ~awq).sum())
        rows[-1].update({f"{group}awq_only": awq_only, f"{group}rtn_only": rtn_only,
                         f"{group}mcnemar_p": mcnemar_p(awq_only, rtn_only)})
    return rows


def plus_minus(form: str, row: dict, key: str) -> str:
    """row[key] ± its standard error (row[key + "_se"]), each in `form`."""
    return form.format(row[key]) + " ± " + form.format(row[key + "_se"]).lstrip("+")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm-dir", default="runs/lm/tiny", help="zoo train outputs, one folder per architecture")
    parser.add_argument("--archs", default="gqa,mla,mamba,hybrid-1in6")
    parser.add_argument("--recall-archs", default="gqa,mla,mamba,hybrid", help="MQAR models to train (empty: none)")
    parser.add_argument("--recall-steps", type=int, default=1500)
    parser.add_argument("--recall-test-examples", type=int, default=2000)
    parser.add_argument("--prompts", type=int, default=2048,
                        help="held-out prompts for greedy agreement (they come from 68 of the standard library's 86 "
                        "validation files, 42%% from one: more prompts narrow AWQ - RTN's error by file only so far)")
    parser.add_argument("--agreement-prompts", choices=("validation", "training"), default="validation",
                        help="where greedy agreement's prompts come from (training: another seed than AWQ's)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--calibration-windows", type=int, default=64, help="AWQ's training-split windows of 256 bytes")
    parser.add_argument("--calibration-prompts", type=int, default=Calibration.prompts,
                        help="training-split prompts whose greedy agreement AWQ's candidates are judged by")
    parser.add_argument("--calibration-examples", type=int, default=256, help="AWQ's MQAR training examples")
    parser.add_argument("--judge-examples", type=int, default=8000, help="fresh MQAR examples (trained N) AWQ's "
                        "candidates are scored on")
    parser.add_argument("--out", default="results/quant_quality")
    args = parser.parse_args()
    torch.set_num_threads(2)
    store = ResultStore(Path(args.out) / "results.jsonl", KEY)
    for arch in filter(None, args.archs.split(",")):
        if not store.done({"task": "lm", "arch": arch, "variant": "none"}):
            for row in lm_rows(arch, Path(args.lm_dir) / arch, args):
                store.append(row)
    for arch in filter(None, args.archs.split(",")):
        if not store.done({"task": "kv", "arch": arch, "variant": "int8"}):
            for row in kv_rows(arch, Path(args.lm_dir) / arch, args):
                store.append(row)
    for arch in filter(None, args.recall_archs.split(",")):
        if not store.done({"task": "mqar", "arch": arch, "variant": "none"}):
            for row in recall_rows(arch, args):
                store.append(row)
    print("| arch | weights | val bpb (Δ) | KL to unquantized (bits/byte) | greedy agreement / first difference (of 256) | "
          "MQAR accuracy (Δ) |")
    print("|---|---|---|---|---|---|")
    recall = {(r["arch"], r["variant"]): r for r in store.rows if r["task"] == "mqar"}
    for row in (r for r in store.rows if r["task"] == "lm"):
        lm = f"{row['val_bpb']:.3f}" + (f" ({row['bpb_delta']:+.3f})" if "bpb_delta" in row else "")
        agree = f"{row['agreement']:.0%} / {row['first_difference']:.0f}" if "agreement" in row else ""
        mqar_arch = "hybrid" if row["arch"].startswith("hybrid") else row["arch"]
        r = recall.get((mqar_arch, row["variant"]))
        mqar = "" if r is None else f"{r['accuracy']:.4f}" + (f" ({r['accuracy_delta']:+.4f})" if "accuracy_delta" in r else "")
        kl = f"{row['kl_bits']:.4f}" if "kl_bits" in row else ""
        print(f"| {row['arch']} | {row['variant']} | {lm} | {kl} | {agree} | {mqar} |")
    print("\n| arch | KV cache | bytes / token | KL before the first difference (bits/byte) | greedy agreement / first "
          "difference (of 256) |")
    print("|---|---|---:|---|---|")
    for row in (r for r in store.rows if r["task"] == "kv"):
        print(f"| {row['arch']} | {row['variant']} | {row['cache_bytes_per_token']} | {row['kl_bits']:.5f} | "
              f"{row['agreement']:.0%} / {row['first_difference']:.0f} |")
    print("\n| arch | AWQ − RTN (paired) | all prompts (± standard error by file / by prompt) | files | in the most "
          "drawn file (prompts) | in the other files |")
    print("|---|---|---|---:|---|---|")
    for row in (r for r in store.rows if r["task"] == "lm" and "agreement_vs_rtn" in r):
        for measure, form in (("agreement", "{:+.1%}"), ("first_difference", "{:+.1f}")):
            if f"{measure}_vs_rtn" not in row:
                continue
            within = {part: plus_minus(form, row, f"{measure}_vs_rtn_{part}") if f"{measure}_vs_rtn_{part}" in row
                      else "" for part in ("top_file", "other_files")}
            print(f"| {row['arch']} | {measure.replace('_', ' ')} | {plus_minus(form, row, measure + '_vs_rtn')} / "
                  f"{form.format(row[measure + '_vs_rtn_se_prompts']).lstrip('+')} | {row['agreement_files']} | "
                  f"{row['top_file']} ({row['top_file_prompts']}): {within['top_file']} | {within['other_files']} |")
    print("\n| MQAR arch | weights | steps | accuracy, trained N (Δ) | held-out N (Δ) |")
    print("|---|---|---:|---|---|")
    for row in (r for r in store.rows if r["task"] == "mqar"):
        delta = (f" ({row['accuracy_delta']:+.4f})", f" ({row['held_out_delta']:+.4f})") if "accuracy_delta" in row else ("", "")
        print(f"| {row['arch']} | {row['variant']} | {row['steps']} | {row['accuracy']:.4f}{delta[0]} | "
              f"{row['held_out_accuracy']:.4f}{delta[1]} |")
    print("\n| MQAR arch | queries | only AWQ answers | only RTN answers | McNemar exact p |")
    print("|---|---|---:|---:|---:|")
    for row in (r for r in store.rows if r["task"] == "mqar" and "mcnemar_p" in r):
        for group, label in (("", "trained N"), ("held_out_", "held-out N")):
            print(f"| {row['arch']} | {label} | {row[group + 'awq_only']} | {row[group + 'rtn_only']} | "
                  f"{row[group + 'mcnemar_p']:.2f} |")

if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
