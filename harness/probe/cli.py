"""`zoo probe`: the probe suite from the command line (options, presets, output files)."""
from pathlib import Path

from harness.probe.report import MAD_TASKS, best_over_grid, markdown_table, write_report
from harness.probe.suite import ProbeSettings, full_grid, run_probe, task_names
from harness.recall.cli import add_ray_option, float_list, publish

# A preset is a list of sweeps written to one results folder (a row names its task, setting and model).
# no plateau stops: a short budget ends before attention's induction jump (in-context recall at length 64 sits at 0.32
# from step 200 to ~1,300, loss flat, then jumps to 1.0), so a run trains on unless solved and its row says why
COMMON = {"d_models": [64], "lrs": [1e-3, 3e-3], "weight_decays": [0.1], "test_examples": 500, "min_steps": None}
PRESETS = {
    # under 20 minutes on 2 cores (BENCHMARKS.md): one setting per MAD-Lab task at length 64, in-context recall at two
    # vocabularies (a fixed state falls as it grows, attention's does not), parity for the state-tracking split (Gated
    # DeltaNet with and without negative eigenvalues); d_model 64, learning rates 1e-3 and 3e-3 at weight decay 0.1
    "cpu-default": [
        # attention's induction jump comes late (step ~1,500 at vocabulary 16, lr 1e-3): it trains longest
        {**COMMON, "archs": ["gqa"], "tasks": ["in-context-recall:seq_len=64"], "max_steps": 2500},
        {**COMMON, "archs": ["gqa"], "tasks": ["in-context-recall:seq_len=64+vocab_size=64"], "max_steps": 2000},
        {**COMMON, "archs": ["mamba2"], "tasks": ["in-context-recall:seq_len=64"], "max_steps": 1000},
        {**COMMON, "archs": ["mamba2"], "tasks": ["in-context-recall:seq_len=64+vocab_size=64"], "max_steps": 800},
        # at d_model 64 gdn's 64 x 64 state per layer holds every pair a length-64 sequence shows; at 32 it binds
        {**COMMON, "archs": ["gdn"], "tasks": ["in-context-recall:seq_len=64"], "d_models": [32, 64],
         "max_steps": 2000},
        {**COMMON, "archs": ["gdn"], "tasks": ["in-context-recall:seq_len=64+vocab_size=64"], "d_models": [32],
         "max_steps": 2000},
        {**COMMON, "archs": ["gqa", "mamba2", "gdn", "gdn-neg"], "tasks": ["parity"], "max_steps": 400},
        {**COMMON, "archs": ["gqa", "mamba2", "gdn"], "max_steps": 300,
         "tasks": ["fuzzy-in-context-recall:seq_len=64", "noisy-in-context-recall:seq_len=64",
                   "selective-copying:seq_len=64", "compression", "memorization"]},
    ],
    # iso-state and iso-parameter rows for attention, Mamba-2 and Gated DeltaNet on in-context recall
    "iso": [{**COMMON, "archs": ["gqa"], "tasks": ["in-context-recall:seq_len=64"], "d_models": [],
             "iso_state": [65536], "iso_params": [50000], "max_steps": 2500},
            {**COMMON, "archs": ["mamba2", "gdn"], "tasks": ["in-context-recall:seq_len=64"], "d_models": [],
             "iso_state": [65536], "iso_params": [50000], "max_steps": 1500}],
    # MAD-Lab's whole grid (every task's baseline and changes; its lr x wd sweep, 3 seeds, d_model 128): a cluster's
    "mad": [{"archs": ["gqa", "mamba", "mamba2", "gdn", "gdn-neg", "linear", "hybrid-3to1"],
             "tasks": full_grid(list(MAD_TASKS)), "d_models": [128], "lrs": [1e-4, 5e-4, 1e-3, 5e-3],
             "weight_decays": [0.0, 0.1], "seeds": [0, 1, 2], "mlp": "swiglu", "min_steps": 2000, "max_steps": 20000},
            {"archs": ["gqa", "mamba", "mamba2", "gdn", "gdn-neg", "linear"], "tasks": ["parity", "s5", "a5"],
             "d_models": [128], "lrs": [1e-4, 5e-4, 1e-3, 5e-3], "weight_decays": [0.0, 0.1], "seeds": [0, 1, 2],
             "mlp": "swiglu", "min_steps": 2000, "max_steps": 20000}],
}


def add_parser(sub, int_list, name_list) -> None:
    p = sub.add_parser("probe", help="train every architecture on MAD-Lab's tasks and state tracking, and chart it",
                       description="Train small models on synthetic probe tasks (MAD-Lab's six: in-context, fuzzy and "
                                   "noisy recall, selective copying, compression, memorization; parity and the S5 / A5 "
                                   "word problems) for every architecture x task setting x size x learning rate x "
                                   "weight decay x seed; rows are appended to OUT/results.jsonl as each run finishes "
                                   "(a re-run skips finished runs); writes OUT/table.md (best lr x wd per model and "
                                   "setting, the MAD score) and three charts. Options override the preset's sweeps.")
    d = ProbeSettings()
    p.add_argument("--preset", default="cpu-default", choices=list(PRESETS), help="sweeps (default: cpu-default)")
    p.add_argument("--archs", type=name_list, help="comma-separated architectures")
    p.add_argument("--tasks", type=name_list,
                   help=f"comma-separated task settings: a task ({', '.join(task_names())}) for its baseline, "
                        f"task:field=value for one field changed (e.g. in-context-recall:vocab_size=64), or "
                        f"task:all for every MAD-Lab setting of it")
    p.add_argument("--d-model", type=int_list, dest="d_models", help="comma-separated widths, or '' for none "
                                                                     f"(default: {','.join(map(str, d.d_models))})")
    p.add_argument("--iso-state", type=int_list, help="comma-separated state / KV bytes per sequence: each "
                                                      "architecture is sized (d_model chosen) to come closest to each")
    p.add_argument("--iso-params", type=int_list, help="comma-separated non-embedding parameter counts, each "
                                                       "architecture sized to each")
    p.add_argument("--lrs", type=float_list, help=f"comma-separated learning rates (default: {d.lrs})")
    p.add_argument("--weight-decays", type=float_list, help=f"comma-separated weight decays (default: "
                                                            f"{d.weight_decays})")
    p.add_argument("--mlp", help=f"channel mixer after each sequence mixer, or none (default: {d.mlp})")
    p.add_argument("--train-examples", type=int, help="training examples per run (default: each task's MAD-Lab size)")
    p.add_argument("--test-examples", type=int, help=f"test examples per set (default: {d.test_examples})")
    p.add_argument("--min-steps", type=int, help=f"steps before a run may stop at a plateau (default: {d.min_steps})")
    p.add_argument("--max-steps", type=int, help=f"optimizer steps per run (default: {d.max_steps})")
    p.add_argument("--batch-size", type=int, help=f"examples per step (default: {d.batch_size})")
    p.add_argument("--seeds", type=int_list, help=f"comma-separated seeds (default: {','.join(map(str, d.seeds))})")
    p.add_argument("--device", help=f"torch device (default: {d.device})")
    p.add_argument("--workers", type=int, help="runs trained at once, each in its own process (default: one per CPU "
                                               "core up to 2 on CPU; 1 on CUDA)")
    p.add_argument("--out", help=f"output folder (default: {d.out})")
    add_ray_option(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_probe)


OPTION_FIELDS = ("archs", "tasks", "d_models", "iso_state", "iso_params", "lrs", "weight_decays", "mlp",
                 "train_examples", "test_examples", "min_steps", "max_steps", "batch_size", "seeds", "device",
                 "workers", "ray")


def expand_tasks(specs: list[str]) -> list[str]:
    """'task:all' becomes every MAD-Lab setting of that task."""
    return [s for spec in specs for s in (full_grid([spec[:-4]]) if spec.endswith(":all") else [spec])]


def sweeps_of(args) -> list[ProbeSettings]:
    given = {name: getattr(args, name) for name in OPTION_FIELDS if getattr(args, name) is not None}
    if "tasks" in given:
        given["tasks"] = expand_tasks(given["tasks"])
    out = Path(args.out) if args.out else ProbeSettings().out
    return [ProbeSettings(**{**preset, **given, "out": out}) for preset in PRESETS[args.preset]]


def cmd_probe(args) -> None:
    sweeps = sweeps_of(args)
    out = sweeps[0].out
    best = best_over_grid(run_probe(sweeps, show_progress=not args.quiet))  # validates every sweep before training
    publish(out, markdown_table(best), lambda: write_report(best, out), sweeps)
