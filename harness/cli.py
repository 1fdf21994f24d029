"""The `zoo` command: list architectures, compare them, load-test the engine, generate text, train them as byte-level
LMs and on associative recall."""
import argparse
import sys
from pathlib import Path

import torch

import zoo
from zoo import checkpoint, checks
from harness.engine.block_manager import ADMISSIONS
from harness.charts import write_charts
from harness.diffusion import DiffusionSampler
from harness.compare import DTYPES, MEASURES, CompareSettings, run_compare
from harness.compare_device import CPU_DEFAULTS, CUDA_DEFAULTS, is_cuda
from harness.engine import Engine
from harness.probe import cli as probe_cli
from harness.prune import cli as prune_cli
from harness import convert_cli, roofline
from harness.recall import cli as recall_cli
from harness.results import settings_dict, write_atomic
from harness.engine.sampling import SamplingParams
from harness.engine.speculative import PROMPT_LOOKUP, SpeculativeConfig
from harness.engine.speculative.config import LOOKAHEAD
from harness.serve import cli as serve_cli
from harness.serve_bench import ServeBenchSettings, run_serve_bench
from harness.serve_bench import markdown_table as serve_table
from harness.serve_charts import write_serve_charts
from harness.table import markdown_table
from harness.train import cli as train_cli
from harness.train import distill_cli
from zoo.registry import make_config
from zoo.weights import check_weights_file, load_weights


def int_list(text: str) -> list[int]:
    try:
        return list(dict.fromkeys(int(part) for part in text.split(",") if part))  # repeats dropped, order kept
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def share_list(text: str) -> list[float]:
    try:
        return list(dict.fromkeys(float(part) for part in text.split(",") if part))  # repeats dropped, order kept
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def joined(values) -> str:
    return ",".join(map(str, values))


def name_list(text: str) -> list[str]:
    return list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))  # repeats dropped, order kept


def cmd_list(args) -> None:
    width = max(map(len, zoo.architectures()))
    for name in zoo.architectures():
        print(f"{name:<{width}}  {zoo.describe(name)}")


def cmd_describe(args) -> None:
    for field, value in zoo.details(args.arch).items():
        if isinstance(value, dict):
            print(f"{field}:")
            for name, text in value.items():
                print(f"  {name}: {text}")
            if not value:
                print("  (none)")
        else:
            print(f"{field}: {value}")


def check_compare_conflicts(args, settings: CompareSettings) -> None:
    """An option given where the rest of the command leaves it unused is refused, naming both, before any work."""
    if args.block_size is not None:  # a bad value is named as such before a combination of good ones is refused
        checks.power_of_two("block_size", args.block_size)
    diffusion = [arch for arch in settings.archs if arch in zoo.architectures() and not zoo.registry.is_causal(arch)]
    unused = [(args.quant_group is not None and "int4" not in settings.quant, "--quant-group",
               f"--quant {','.join(settings.quant)} has no int4"),
              (args.quant_method is not None and set(settings.quant) <= {"none"}, "--quant-method",
               "--quant none quantizes nothing"),
              (args.block_size is not None and settings.kv_cache == "contiguous", "--block-size",
               "--kv-cache contiguous has no blocks"),
              (args.kv_budgets is not None and set(settings.kv_policies) <= {"none"}, "--kv-budgets",
               "--kv-policies none evicts nothing")]
    unused += [(getattr(args, dest) is not None and not diffusion, option(dest),
                f"--archs {','.join(settings.archs)} has no masked diffusion LM")
               for dest in ("diffusion_steps", "block_length", "diffusion_caches")]
    for given, name, why in unused:
        if given:
            raise ValueError(f"{name} would be ignored: {why}; leave {name} out or change the other option")


def cmd_compare(args) -> None:
    d = CompareSettings()
    given = {name: getattr(d, name) if getattr(args, name) is None else getattr(args, name)
             for name in ("block_size", "diffusion_caches", "quant_group", "quant_method", "kv_budgets")
             }  # None: not typed
    settings = CompareSettings(archs=args.archs, preset=args.preset, contexts=args.contexts, batches=args.batches,
                               new_tokens=args.new_tokens, dtype=args.dtype, kv_cache=args.kv_cache,
                               device=args.device, seed=args.seed, out=Path(args.out),
                               diffusion_steps=args.diffusion_steps, block_length=args.block_length,
                               weights=Path(args.weights) if args.weights else None, quant=args.quant,
                               kv_dtypes=args.kv_dtypes, kv_policies=args.kv_policies, measure=args.measure,
                               cuda_graphs=args.cuda_graphs,
                               ray=args.ray, **given)
    check_compare_conflicts(args, settings)
    rows = run_compare(settings, show_progress=not args.quiet)
    measured = [r for r in rows if not r.get("skipped")]
    table = (markdown_table(measured) if measured else "") + skipped_text([r for r in rows if r.get("skipped")])
    write_atomic(settings.out / "table.md", table)
    charts = write_charts(measured, settings.out) if measured else []
    print(table)
    rated = [r for r in measured if r.get("stream_gb_s")]
    if rated:
        print(rates_text(rated))
    probed = [r for r in measured if r.get("measure") == "decode-probe"]
    if probed:
        print(f"decode-probe: {len(probed)} cells timed {probed[0]['new_tokens']} decode steps at their context over "
              f"caches filled at random as if prefilled; no prefill ran, so TTFT and TPOT are blank")
    if is_cuda(settings.device):
        print(graphs_text(measured))
    trained = [r for r in measured if "val_bpb" in r]
    if trained:
        print(f"val bpb: measured here on {trained[0]['val_windows']} fixed validation windows at context "
              f"{trained[0]['val_context']} of the checkpoints' corpus (a diffusion LM's: its ELBO bound); "
              f"unigram baseline {trained[0]['unigram_bpb']:.3f} bpb")
    print(f"settings: {settings_dict(settings)}")
    print(f"wrote {settings.out / 'results.jsonl'}, {settings.out / 'table.md'}, " + ", ".join(str(c) for c in charts))


def rates_text(rows: list[dict]) -> str:
    """The roofline's ceilings as the results rows record them: the read rate that prices the floor (each cell's own,
    where its read rates were swept around its steps), and torch's GEMV rate beside it (a library's, never the
    floor)."""
    row = rows[-1]
    gemv = f"; torch's GEMV reaches {row['gemv_gb_s']:.1f} GB/s" if row.get("gemv_gb_s") else ""
    read = row.get("run_read_gb_s") or row.get("read_gb_s") or row["stream_gb_s"]
    text = (f"roofline ceilings: memory read {read:.1f} GB/s (past any cache), {row['matmul_gflop_s']:.0f} GFLOP/s "
            f"matmul{gemv} ({row['rates_how']}); floor = max(step bytes / the read rate for a working set of that "
            f"size, step FLOPs / matmul)")
    swept = [r for r in rows if r.get("read_before_gb_s")]
    if not swept:
        return text
    moved = [r for r in swept if r["read_moved"]]
    low, high = min(r["stream_gb_s"] for r in swept), max(r["stream_gb_s"] for r in swept)
    lines = [f"\n- {r['arch']} context {r['context']} batch {r['batch']}: {r['read_before_gb_s']:.1f} -> "
             f"{r['read_after_gb_s']:.1f} GB/s" for r in moved]
    return (f"{text}\neach cell's floor is priced at the read rates swept just before and after its steps (the "
            f"higher): {low:.1f}-{high:.1f} GB/s for the steps' bytes across {len(swept)} cells; in {len(moved)} of "
            f"them the rate moved more than {roofline.DISTURBANCE:.0%} across the steps"
            + (": the machine changed under them" if moved else "") + "".join(lines))


def skipped_text(rows: list[dict]) -> str:
    """The cells compare did not run, each with its reason, under the table ("" when none)."""
    if not rows:
        return ""
    lines = [f"- {r['arch']} context {r['context']} batch {r['batch']}: {r['skipped']}" for r in rows]
    return "\nSkipped (not run; delete their rows from results.jsonl to try again):\n\n" + "\n".join(lines) + "\n"


def graphs_text(rows: list[dict]) -> str:
    """One line: in how many autoregressive cells decode replayed CUDA graphs, their memory, or why they were off."""
    engine_rows = [r for r in rows if not r.get("steps")]
    captured = [r for r in engine_rows if r.get("cuda_graphs")]
    if captured:
        return (f"CUDA graphs: on in {len(captured)} of {len(engine_rows)} cells, holding up to "
                f"{max(r['graph_bytes'] for r in captured) / 2**20:.1f} MiB")
    reasons = sorted({r["cuda_graphs_off"] for r in engine_rows if r.get("cuda_graphs_off")})
    return "CUDA graphs: off" + (f" ({'; '.join(reasons)})" if reasons else "")


def shared_prefix(text: str) -> tuple[int, int, int]:
    parts = text.split(":")
    try:
        if len(parts) == 3:
            return tuple(int(part) for part in parts)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected N:PREFIX_LEN:SUFFIX_LEN (three integers), got {text!r}")


# serve-bench options (argparse dests) where the first, given, leaves the second's value unused, and why
SERVE_BENCH_CONFLICTS = (
    ("concurrency", "request_rates", "a closed loop of N requests in flight replaces the Poisson arrivals"),
    ("shared_prefix", "input_len", "each prompt is PREFIX_LEN + SUFFIX_LEN tokens"),
    *((("url", engine_option, "the server runs its own model and engine")
       for engine_option in ("archs", "admission", "max_num_batched_tokens", "prefix_caching", "max_batch",
                             "num_blocks"))),
)


def option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_serve_bench_conflicts(args) -> None:
    """Options that would silently leave another unused are refused, naming both, before any work."""
    for first, second, why in SERVE_BENCH_CONFLICTS:
        if getattr(args, first) is not None and getattr(args, second) is not None:
            raise ValueError(f"{option(first)} and {option(second)} conflict: {why}, so {option(second)} would be "
                             f"ignored; pass only one of them")
    if args.shared_prefix is not None and args.shared_prefix[0] < 1:
        raise ValueError(f"--shared-prefix {':'.join(map(str, args.shared_prefix))}: N must be >= 1, got "
                         f"{args.shared_prefix[0]} (no system prompts would ignore PREFIX_LEN and SUFFIX_LEN; leave "
                         f"--shared-prefix out for the random workload)")


def cmd_serve_bench(args) -> None:
    d = ServeBenchSettings()
    num_prefixes, prefix_len, suffix_len = args.shared_prefix or (0, d.prefix_len, d.suffix_len)
    settings = ServeBenchSettings(
        archs=d.archs if args.archs is None else args.archs, preset=args.preset, url=args.url,
        request_rates=d.request_rates if args.request_rates is None else args.request_rates,
        concurrency=args.concurrency, num_requests=args.num_requests,
        input_len=d.input_len if args.input_len is None else args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, num_prefixes=num_prefixes, prefix_len=prefix_len, suffix_len=suffix_len,
        ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms,
        admission=d.admission if args.admission is None else args.admission,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_caching=d.prefix_caching if args.prefix_caching is None else args.prefix_caching,
        max_batch=d.max_batch if args.max_batch is None else args.max_batch, num_blocks=args.num_blocks,
        seed=args.seed, out=Path(args.out))
    settings.validate()  # a bad value is named as such before a combination of good ones is refused
    check_serve_bench_conflicts(args)
    rows = run_serve_bench(settings, show_progress=not args.quiet)
    table = serve_table(rows, settings.archs)
    write_atomic(settings.out / "table.md", table)
    charts = write_serve_charts(rows, settings.out)
    print(table)
    print(f"settings: {settings_dict(settings)}")
    print(f"wrote {settings.out / 'results.jsonl'}, {settings.out / 'table.md'}, " + ", ".join(str(c) for c in charts))


def cmd_generate(args) -> None:
    tokenizer = zoo.ByteTokenizer()
    # the sampling arguments and the weights file are checked before the model is built
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                            stop_token_ids=(tokenizer.eos_id,))
    folder = args.weights is not None and Path(args.weights).is_dir()  # a zoo.save / zoo train folder: its own config
    if folder:
        checkpoint.check_checkpoint_folder(args.weights)
    elif args.weights:
        check_weights_file(args.weights)
    speculative = speculative_setting(args)
    torch.manual_seed(args.seed if args.seed is not None else 0)
    if folder:
        model = zoo.load(args.weights).to(dtype=DTYPES[args.dtype])
    else:
        model = zoo.build(args.arch, preset=args.preset).to(dtype=DTYPES[args.dtype])
    if args.weights and not folder:
        load_weights(model, args.weights, f"{args.arch} (preset {args.preset})")
    prompt_ids = tokenizer.encode(args.prompt)
    if not model.config.causal:
        generate_diffusion(model, prompt_ids, tokenizer, args)
        return
    engine = Engine(model, max_batch=1, max_seq_len=min(model.config.max_seq_len, len(prompt_ids) + args.max_new_tokens),
                    kv_cache=args.kv_cache, speculative=speculative)
    out = engine.generate([prompt_ids], params)[0]
    print(args.prompt + tokenizer.decode(out.token_ids))
    m = out.metrics
    stats = engine.speculative_stats
    print(f"[{model.config.name}: {len(out.token_ids)} tokens, finish={out.finish_reason}, "
          f"TTFT {1000 * m.ttft:.1f} ms, TPOT {1000 * m.tpot:.2f} ms, E2E {1000 * m.e2e:.1f} ms"
          + (f"; draft acceptance {stats.acceptance_rate:.2f}, {stats.tokens_per_forward:.2f} tokens per target "
             f"forward" if stats else "")
          + ("" if args.weights else "; random weights: pass --weights for a trained model") + "]", file=sys.stderr)


def speculative_setting(args) -> SpeculativeConfig | None:
    """--draft: prompt_lookup, lookahead, or zoo.save / zoo train folders, comma-separated for several (drafts with
    the target's vocabulary); --branches and --tree-budget shape a tree."""
    if args.draft is None:
        return None
    shape = {"num_speculative_tokens": args.num_speculative_tokens, "branches": args.branches,
             "tree_budget": args.tree_budget, "chain_fallback": args.chain_fallback}
    if args.draft in (PROMPT_LOOKUP, LOOKAHEAD):
        return SpeculativeConfig(args.draft, **shape)
    folders = args.draft.split(",")
    for folder in folders:
        checkpoint.check_checkpoint_folder(folder)
    drafts = tuple(zoo.load(folder) for folder in folders)
    return SpeculativeConfig(drafts if len(drafts) > 1 else drafts[0], **shape)


def generate_diffusion(model, prompt_ids: list[int], tokenizer, args) -> None:
    """A masked diffusion LM fills the answer block by block through the LLaDA sampler (no engine, no EOS stop)."""
    block_length = args.block_length or args.max_new_tokens
    sampler = DiffusionSampler(model, steps=args.steps or args.max_new_tokens, block_length=block_length,
                               remasking=args.remasking, temperature=args.temperature,
                               cache=None if args.diffusion_cache == "none" else args.diffusion_cache,
                               threshold=args.threshold)
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    out = sampler.generate([prompt_ids], args.max_new_tokens, generator=generator)
    print(args.prompt + tokenizer.decode(out.token_ids[0]))
    print(f"[{args.arch}/{args.preset}: {args.max_new_tokens} tokens in {out.forward_passes} forward passes "
          f"({out.tokens_per_forward:.2f} tokens/forward), first block {1000 * out.first_block_s:.1f} ms, "
          f"E2E {1000 * out.wall_s:.1f} ms" + ("" if args.weights else "; random weights: pass --weights for a "
                                               "trained model") + "]", file=sys.stderr)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zoo", description="archzoo: run LLM decoder architectures through one harness and compare them.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the registered architectures, one line each").set_defaults(func=cmd_list)
    d = sub.add_parser("describe", help="everything the registry says about one architecture: its settings with "
                                        "types and defaults, causal or not, recall defaults, HF class")
    d.add_argument("arch", help="a registered architecture (see `zoo list`)")
    d.set_defaults(func=cmd_describe)

    cpu, gpu = CPU_DEFAULTS, CUDA_DEFAULTS
    c = sub.add_parser("compare", help="measure cache bytes, TTFT, TPOT, decode throughput, MBU and the roofline floor per architecture",
                       description="Run every architecture x context x batch cell through the same engine. Rows are "
                                   "appended to OUT/results.jsonl as each cell finishes (a re-run skips finished cells); "
                                   "prints a table and writes OUT/table.md and PNG charts. CUDA defaults: with --device "
                                   f"cuda, each option you leave out takes the GPU default instead: preset {gpu.preset}, "
                                   f"contexts {joined(gpu.contexts)}, batches {joined(gpu.batches)}, dtype {gpu.dtype}, "
                                   f"kv-cache {gpu.kv_cache}, measure {gpu.measure}, CUDA graphs on (estimated under 3 "
                                   "minutes on one H100); a cell whose cache does not fit in the GPU's free memory is "
                                   "skipped with the reason. See docs/gpu.md.")
    d = CompareSettings()
    c.add_argument("--archs", type=name_list, default=d.archs, help=f"comma-separated architectures (default: {','.join(d.archs)}; see `zoo list`)")
    c.add_argument("--preset", choices=list(zoo.PRESETS), help=f"model size (default: {cpu.preset}; CUDA default: "
                                                               f"{gpu.preset}; with --weights, the checkpoints' own, "
                                                               f"which a given --preset must match)")
    c.add_argument("--contexts", type=int_list, help=f"comma-separated prompt lengths in tokens (default: "
                                                     f"{joined(cpu.contexts)}; CUDA default: {joined(gpu.contexts)})")
    c.add_argument("--batches", type=int_list, help=f"comma-separated batch sizes (default: {joined(cpu.batches)}; "
                                                    f"CUDA default: {joined(gpu.batches)})")
    c.add_argument("--new-tokens", type=int, help=f"tokens decoded per request, greedy; with --measure decode-probe, "
                   f"decode steps timed (default: {cpu.new_tokens}; CUDA default: {gpu.new_tokens})")
    c.add_argument("--dtype", choices=list(DTYPES), help=f"weights and cache dtype (default: {cpu.dtype}; CUDA "
                                                         f"default: {gpu.dtype})")
    c.add_argument("--kv-cache", choices=["contiguous", "paged"], help=f"KV cache layout (default: {cpu.kv_cache}; "
                                                                       f"CUDA default: {gpu.kv_cache})")
    c.add_argument("--block-size", type=int, help=f"tokens per block for the paged layout (default: {d.block_size})")
    c.add_argument("--device", default=d.device, help=f"torch device, e.g. cpu or cuda; cuda changes the defaults "
                                                      f"marked CUDA default (default: {d.device})")
    c.add_argument("--measure", choices=list(MEASURES), help="generate: prefill the prompts, then decode new-tokens "
                   "(TTFT, TPOT, decode steps); decode-probe: caches filled at random as if the prompts were "
                   "prefilled, new-tokens decode steps timed at the context held fixed, no prefill (no TTFT, TPOT) "
                   f"(default: {cpu.measure}; CUDA default: {gpu.measure})")
    c.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, help="replay the decode step from CUDA "
                   "graphs captured per batch-size bucket (--no-cuda-graphs: eager launches); each row records "
                   "whether they ran and their bytes (default: the engine's: on for CUDA where it can, off on CPU)")
    c.add_argument("--seed", type=int, default=d.seed, help=f"seed for weights and prompts (default: {d.seed})")
    c.add_argument("--out", default=str(d.out), help=f"output folder (default: {d.out})")
    c.add_argument("--diffusion-steps", type=int_list, help="masked diffusion LMs: comma-separated sampler steps "
                   "(default: new_tokens, new_tokens/4, new_tokens/16 where they divide into the blocks)")
    c.add_argument("--block-length", type=int, help="masked diffusion LMs: answer tokens per block, left to right "
                   "(default: 32 where new_tokens splits into them, else new_tokens)")
    c.add_argument("--diffusion-caches", type=name_list,
                   help=f"masked diffusion LMs: Fast-dLLM caches to measure (default: {','.join(d.diffusion_caches)})")
    c.add_argument("--weights", metavar="DIR", help="trained models instead of random weights: DIR holds one `zoo "
                   "train` output folder per architecture, named by it (DIR/gqa, DIR/mamba, ...); each row adds the "
                   "model's validation bits per byte and training budget, and quality_vs_cache.png is drawn "
                   "(default: none, random weights)")
    c.add_argument("--quant", type=name_list, default=d.quant, help="comma-separated weight quantizations to run each "
                   "architecture at: none, int8 (per output channel), int4 (per group of input columns) "
                   f"(default: {','.join(d.quant)}); with --weights, memory_vs_quality.png is drawn")
    c.add_argument("--quant-group", type=int, help=f"int4 group size: 32, 64 or 128 "
                   f"(default: {d.quant_group})")
    c.add_argument("--quant-method", choices=["rtn", "awq"], help="round to nearest, or "
                   "activation-aware scales calibrated on training-corpus windows and judged by greedy agreement on "
                   "training prompts (default: rtn)")
    c.add_argument("--kv-dtypes", type=name_list, default=d.kv_dtypes, help="comma-separated per-token cache "
                   "storage: auto (the model's dtype), int8 or fp8 (e4m3; either with a scale per token and KV head) "
                   f"(default: {','.join(d.kv_dtypes)})")
    c.add_argument("--kv-policies", type=name_list, default=d.kv_policies, help="comma-separated KV eviction by "
                   "score for the attention layers: none, h2o (heavy hitters: the most attention received, half the "
                   "budget the newest tokens), tova (the newest query's attention), snapkv (the prompt's last 32 queries' "
                   "pooled votes) "
                   f"(default: {','.join(d.kv_policies)})")
    c.add_argument("--kv-budgets", type=share_list, help="with --kv-policies: comma-separated "
                   "shares of the context an evicting layer keeps, each in (0, 1] "
                   f"(default: {joined(d.kv_budgets)})")
    c.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run each model's cells as a Ray task holding a whole machine (all its CPUs; one GPU on "
                        "CUDA): on the cluster at ADDRESS ('auto': the one this machine is in), or without ADDRESS "
                        "on a new local instance; this process writes results.jsonl; needs pip install -e '.[ray]'")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_compare)

    add_serve_bench_parser(sub)

    g = sub.add_parser("generate", help="generate text from a prompt (byte-level tokenizer)")
    g.add_argument("--arch", default="gqa", help="architecture (default: gqa)")
    g.add_argument("--preset", default="small", choices=list(zoo.PRESETS), help="model size (default: small)")
    g.add_argument("--prompt", default="", help="prompt text (default: empty; a diffusion LM fills the answer from nothing)")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats; 1 = off")
    g.add_argument("--seed", type=int, default=None, help="seed for weights and sampling")
    g.add_argument("--kv-cache", default="contiguous", choices=["contiguous", "paged"], help="KV cache layout")
    g.add_argument("--dtype", default="float32", choices=list(DTYPES), help="weights dtype (default: float32)")
    g.add_argument("--weights", default=None, help="a zoo train output folder (or a zoo.save folder: its own "
                   "architecture and size), or a .safetensors (or tensors-only .pt) state dict for --arch/--preset")
    g.add_argument("--draft", default=None, help="speculative decoding: 'prompt_lookup', 'lookahead', or draft "
                                                  "models' zoo train / zoo.save folders, comma-separated for a tree "
                                                  "of their chains (same vocabulary as the target)")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="k: tokens the draft proposes per step "
                                                                         "(default: 4)")
    g.add_argument("--branches", type=int, default=1, help="chains per proposer: more than one makes a token tree "
                                                           "(default: 1)")
    g.add_argument("--tree-budget", type=int, default=None, help="a tree of this many tokens grown by the draft's "
                                                                 "probabilities, num-speculative-tokens deep")
    g.add_argument("--chain-fallback", action="store_true", help="where the target cannot verify a tree (a window, "
                                                                 "a recurrent state), verify the first chain alone")
    g.add_argument("--steps", type=int, help="masked diffusion LMs: sampler steps (forward passes) for the whole "
                                             "answer (default: max-new-tokens, one token per step)")
    g.add_argument("--block-length", type=int, help="masked diffusion LMs: answer tokens per block (default: the "
                                                    "whole answer)")
    g.add_argument("--remasking", default="low_confidence", choices=["low_confidence", "random"],
                   help="masked diffusion LMs: which predictions a step keeps (default: low_confidence)")
    g.add_argument("--diffusion-cache", default="none", choices=["none", "prefix", "dual"],
                   help="masked diffusion LMs: Fast-dLLM approximate cache (default: none)")
    g.add_argument("--threshold", type=float, help="masked diffusion LMs: unmask every prediction at least this "
                                                   "confident (Fast-dLLM parallel decoding) instead of a fixed count")
    g.set_defaults(func=cmd_generate)

    add_export_parser(sub)
    train_cli.add_parser(sub)
    distill_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    recall_cli.add_parser(sub, int_list, name_list)
    probe_cli.add_parser(sub, int_list, name_list)
    prune_cli.add_parser(sub)
    convert_cli.add_parser(sub)
    return p


def add_export_parser(sub) -> None:
    e = sub.add_parser("export", help="write a model as a llama.cpp GGUF file (mha, gqa, mqa: Llama-shaped models)",
                       description="Write an mha / gqa / mqa model (random weights unless --weights) as a GGUF file "
                                   "that llama.cpp loads as its llama architecture, Q and K rows in llama.cpp's RoPE "
                                   "order, with a placeholder vocabulary (one entry per id: feed token ids). Needs the "
                                   "gguf package: pip install -e '.[peers]'.")
    e.add_argument("--gguf", required=True, metavar="PATH", help="the GGUF file to write")
    e.add_argument("--arch", default="gqa", help="architecture: mha, gqa or mqa (default: gqa)")
    e.add_argument("--preset", default="base", choices=list(zoo.PRESETS), help="model size (default: base)")
    e.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"],
                   help="2-D weights as stored in the file; norm gains stay f32 (default: f32)")
    e.add_argument("--weights", default=None, help="a zoo train output folder (or a zoo.save folder: its own "
                   "architecture and size), or a .safetensors (or tensors-only .pt) state dict for --arch/--preset")
    e.add_argument("--seed", type=int, default=0, help="seed for random weights (default: 0)")
    e.set_defaults(func=cmd_export)


def cmd_export(args) -> None:
    try:
        from zoo import gguf_export  # the gguf package is optional: the peers (or test) extra
    except ModuleNotFoundError as error:
        raise ValueError(f"{error}: install the peers extra (pip install -e '.[peers]')") from None
    # everything is checked before any model is built
    if not Path(args.gguf).parent.is_dir():
        raise ValueError(f"--gguf {args.gguf!r}: folder {str(Path(args.gguf).parent)!r} does not exist")
    folder = args.weights is not None and Path(args.weights).is_dir()
    if folder:
        config = checkpoint.load_config(args.weights)
    else:
        config = make_config(args.arch, args.preset)
        if args.weights:
            check_weights_file(args.weights)
    gguf_export.check_exportable(config)
    torch.manual_seed(args.seed)
    model = zoo.load(args.weights) if folder else zoo.build(args.arch, preset=args.preset)
    if args.weights and not folder:
        load_weights(model, args.weights, f"{args.arch} (preset {args.preset})")
    path = gguf_export.export_gguf(model, args.gguf, args.dtype)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {config.name}, {args.dtype}"
          + ("" if args.weights else ", random weights: pass --weights for a trained model") + ")")


def add_serve_bench_parser(sub) -> None:
    s = sub.add_parser("serve-bench", help="load-test the engine: Poisson arrivals (or N in flight), vLLM's serving "
                                           "metrics (TTFT, TPOT, ITL, E2EL, throughput, goodput) per architecture",
                       description="An open-loop load generator on the engine, in process: synthetic requests arrive "
                                   "as a Poisson process at each request rate (or, with --concurrency, N at a time in a "
                                   "closed loop); TTFT counts from each request's scheduled arrival. Rows (vLLM "
                                   "benchmark_serving's field names) are appended to OUT/results.jsonl as each "
                                   "architecture x load cell finishes (a re-run skips finished cells); prints a table "
                                   "and writes OUT/table.md and latency and throughput charts.")
    d = ServeBenchSettings()
    s.add_argument("--archs", type=name_list, help=f"comma-separated architectures (default: {','.join(d.archs)}; "
                                                   f"see `zoo list`)")
    s.add_argument("--url", help="measure this OpenAI-compatible server (e.g. http://127.0.0.1:8000, `zoo serve` or "
                                 "vLLM) with the same workload, over HTTP, instead of the engine in process")
    s.add_argument("--preset", default=d.preset, choices=list(zoo.PRESETS), help=f"model size (default: {d.preset})")
    s.add_argument("--request-rates", type=recall_cli.float_list,
                   help="comma-separated Poisson arrival rates in requests/s, not with --concurrency (default: "
                        f"{','.join(f'{r:g}' for r in d.request_rates)})")
    s.add_argument("--concurrency", type=int_list, help="comma-separated requests in flight: a closed loop (each "
                                                        "request that ends lets the next in) instead of --request-rates")
    s.add_argument("--num-requests", type=int, default=d.num_requests, help=f"requests per cell (default: {d.num_requests})")
    s.add_argument("--input-len", type=int, help=f"mean prompt tokens, not with --shared-prefix (default: "
                                                 f"{d.input_len})")
    s.add_argument("--output-len", type=int, default=d.output_len, help=f"mean output tokens, decoded in full (default: {d.output_len})")
    s.add_argument("--range-ratio", type=float, default=d.range_ratio, help="lengths uniform in [len * (1 - r), len * "
                   f"(1 + r)], r in [0, 1) (default: {d.range_ratio})")
    s.add_argument("--shared-prefix", type=shared_prefix, metavar="N:PREFIX_LEN:SUFFIX_LEN",
                   help="the shared-prefix workload instead of --input-len: each prompt is one of N random system "
                        "prompts of PREFIX_LEN tokens followed by its own SUFFIX_LEN tokens")
    s.add_argument("--ttft-slo-ms", type=train_cli.optional_number("milliseconds"), default=d.ttft_slo_ms, help=f"goodput counts requests with TTFT at "
                   f"most this ('none': no TTFT SLO; default: {d.ttft_slo_ms:g})")
    s.add_argument("--tpot-slo-ms", type=train_cli.optional_number("milliseconds"), default=d.tpot_slo_ms, help=f"... and TPOT at most this ('none': "
                   f"no TPOT SLO; default: {d.tpot_slo_ms:g})")
    s.add_argument("--admission", choices=list(ADMISSIONS), help=f"engine admission (default: {d.admission})")
    s.add_argument("--max-num-batched-tokens", type=int, help="tokens per engine step: chunked prefill (default: off, "
                                                              "whole prompts)")
    s.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction,
                   help="share cached prompt blocks between requests (default: on; off for recurrent-state models)")
    s.add_argument("--max-batch", type=int, help=f"engine batch slots (default: {d.max_batch})")
    s.add_argument("--num-blocks", type=int, help="paged pool blocks per cache group (default: room for max-batch "
                                                  "worst-case requests)")
    s.add_argument("--seed", type=int, default=d.seed, help=f"seed for weights, workload and arrivals (default: {d.seed})")
    s.add_argument("--out", default=str(d.out), help=f"output folder (default: {d.out})")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_serve_bench)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as error:
        print(f"zoo {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
