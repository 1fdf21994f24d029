"""Evidence for the recall plateau rule: replay it on full learning curves.

Train without early stopping (`zoo recall ... --min-steps M --max-steps M`, so every run keeps its whole curve), then

    python benchmarks/plateau_rule.py RESULTS.jsonl [RESULTS.jsonl ...] --min-steps 600

For every run and every rule (the old one: accuracy gain alone; the new one at several loss-fall fractions:
harness/recall/train.py's convergence with chance and the training loss), the first evaluation at or after
--min-steps where the rule says "plateau" is where that run would have stopped. A stop is premature when the run's
final accuracy beats the accuracy at the stop by more than --margin: more steps would have changed the row.
"""
import argparse
import json
from pathlib import Path

import harness.recall.train as train

LOSS_FALLS = (0.001, 0.002, 0.005, 0.01, 0.02)


def stop_point(history: list[dict], chance: float, min_steps: int, rule: str, fall: float) -> int | None:
    """Index of the first evaluation at which `rule` ("old": gain only, "new": with chance and loss) calls a plateau."""
    for i, point in enumerate(history):
        if point["step"] < min_steps:
            continue
        prefix = history[: i + 1]
        if rule == "old":
            prefix = [{k: v for k, v in p.items() if k != "loss"} for p in prefix]
            verdict = train.convergence(prefix, False, 0.0)
        else:
            saved, train.PLATEAU_LOSS_FALL = train.PLATEAU_LOSS_FALL, fall
            try:
                verdict = train.convergence(prefix, False, chance)
            finally:
                train.PLATEAU_LOSS_FALL = saved
        if verdict == "plateau":
            return i
    return None


def rows_of(paths: list[Path]) -> list[dict]:
    return [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--min-steps", type=int, default=600, help="the earliest step a run may stop (default: 600)")
    p.add_argument("--margin", type=float, default=0.05, help="final - at-stop accuracy that makes a stop premature")
    args = p.parse_args(argv)
    rules = [("old", 0.0)] + [("new", fall) for fall in LOSS_FALLS]
    print("| run | final acc (step) | " + " | ".join(f"{r} {f:g}" if r == "new" else r for r, f in rules) + " |")
    print("|---|---:|" + "---:|" * len(rules))
    premature = {rule: 0 for rule in rules}
    saved = {rule: 0 for rule in rules}
    rows = [r for r in rows_of(args.results) if r.get("history")]
    for row in rows:
        history = row["history"]
        final = train.point_accuracy(history[-1])
        cells = []
        for rule in rules:
            i = stop_point(history, row.get("chance", 0.0), args.min_steps, *rule)
            if i is None:
                cells.append("trains on")
                continue
            at_stop = train.point_accuracy(history[i])
            early = final - at_stop > args.margin
            premature[rule] += early
            saved[rule] += history[-1]["step"] - history[i]["step"]
            cells.append(f"{history[i]['step']}: {at_stop:.3f}" + (" **premature**" if early else ""))
        name = f"{row['arch']} d={row['d_model']} lr={row['lr']:g} seed={row['seed']}"
        print(f"| {name} | {final:.3f} ({history[-1]['step']}) | " + " | ".join(cells) + " |")
    print("\n| rule | premature stops | steps saved |\n|---|---:|---:|")
    for rule in rules:
        label = "old (gain only)" if rule[0] == "old" else f"new, loss fall {rule[1]:g}"
        print(f"| {label} | {premature[rule]} of {len(rows)} | {saved[rule]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
