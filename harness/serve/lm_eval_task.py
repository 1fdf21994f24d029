"""A small lm-evaluation-harness task from local data, for evaluating archzoo models through `zoo serve` with
lm-eval's `local-completions` client: next-line prediction on held-out standard-library files (those the training
corpus's by-file split keeps for validation, harness/train/corpus.py). Each document is two lines of context and the
line that follows them. Two tasks over the same documents:

- `archzoo_stdlib_next_line` (loglikelihood): log p(next line | context), and whether it is the greedy
  continuation (lm-eval's acc), with perplexity over the documents;
- `archzoo_stdlib_next_line_gen` (generate_until "\\n", greedy): exact match of the generated line.

    python -m harness.serve.lm_eval_task OUT_FOLDER [DOCS]    # writes the data and the two task files
    lm_eval --model local-completions --include_path OUT_FOLDER --tasks archzoo_stdlib_next_line \\
        --model_args model=gqa,base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=remote
"""
import json
import sys
from pathlib import Path

from harness.train.corpus import VALIDATION_SHARE, hash_fraction, stdlib_files, stdlib_root

TASK = "archzoo_stdlib_next_line"
MAX_LINE = 60  # characters of a target line: short enough to generate in a few dozen tokens


def next_line_docs(count: int) -> list[dict]:
    """`count` documents {"context": two lines, "target": the next line, "source": file:line}, from held-out files
    in path order, lines with code on them only."""
    root = stdlib_root()
    held_out = sorted(p for p in stdlib_files(root) if hash_fraction(p.relative_to(root).as_posix()) < VALIDATION_SHARE)
    docs = []
    for path in held_out:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for i in range(2, len(lines), 7):  # spaced, so one file does not supply every document
            context, target = lines[i - 2:i], lines[i]
            if all(line.strip() for line in (*context, target)) and len(target) <= MAX_LINE:
                docs.append({"context": "\n".join(context) + "\n", "target": target,
                             "source": f"{path.relative_to(root).as_posix()}:{i + 1}"})
                if len(docs) == count:
                    return docs
    raise ValueError(f"the held-out standard-library files give only {len(docs)} documents, not {count}")


def task_yaml(name: str, data: Path, generate: bool) -> str:
    common = (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
              "test_split: test\ndoc_to_text: \"{{context}}\"\ndoc_to_target: \"{{target}}\"\n"
              "target_delimiter: \"\"\n")  # the context ends with its newline: the line follows it as it is
    if generate:
        return common + ("output_type: generate_until\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 24\n"
                         "  do_sample: false\n  temperature: 0\nmetric_list:\n  - metric: exact_match\n"
                         "    aggregation: mean\n    higher_is_better: true\n")
    return common + ("output_type: loglikelihood\nmetric_list:\n  - metric: perplexity\n    aggregation: perplexity\n"
                     "    higher_is_better: false\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")


def write_task(folder: Path, count: int = 16) -> list[dict]:
    """The documents as folder/data.jsonl and the two tasks' YAML beside it (lm-eval's --include_path folder)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    docs = next_line_docs(count)
    data = (folder / "data.jsonl").resolve()
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (folder / f"{TASK}.yaml").write_text(task_yaml(TASK, data, generate=False))
    (folder / f"{TASK}_gen.yaml").write_text(task_yaml(f"{TASK}_gen", data, generate=True))
    return docs


if __name__ == "__main__":
    written = write_task(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 16)
    print(f"wrote {len(written)} documents and the tasks {TASK}, {TASK}_gen to {sys.argv[1]}")
