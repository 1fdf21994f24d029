"""lm-evaluation-harness's `local-completions` client evaluating an archzoo model through `zoo serve` on the repo's
own task (harness/serve/lm_eval_task.py: next-line prediction on held-out standard-library files), with lm-eval's
"remote" tokenizer (the server's /tokenize), and its scores equal to the same quantities computed in process: each
document's log-likelihood and greedy flag from one forward of the model, each generated line from Engine.generate."""
import math

import lm_eval
import pytest
import torch
from lm_eval.tasks import TaskManager

from harness import Engine, SamplingParams
from harness.serve.lm_eval_task import TASK, write_task
from test_serve import MODEL, TOKENIZER, VOCAB, Server  # tests/ is on sys.path under pytest
from helpers import random_model  # tests/ is on sys.path under pytest

DOCS = 6


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    model = random_model("gqa", vocab_size=VOCAB)
    server = Server(Engine(model, max_batch=4, max_seq_len=512, kv_cache="paged"))
    folder = tmp_path_factory.mktemp("lm_eval_task")
    docs = write_task(folder, DOCS)
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model={MODEL},base_url={server.url}/v1/completions,tokenizer_backend=remote,"
                       f"num_concurrent=1,max_retries=1,max_length=512",
            # only the repo's two tasks indexed: lm-eval's ~14,000 built-in task files would take ~10 s to read
            tasks=[TASK, f"{TASK}_gen"], task_manager=TaskManager(include_path=str(folder), include_defaults=False),
            log_samples=True, batch_size=1)
    finally:
        server.stop()
    return model, docs, results


def in_process_loglikelihood(model, context: str, target: str) -> tuple[float, bool]:
    """log p(target | context) and whether target is the greedy continuation, as lm-eval defines the pair: the
    context's trailing whitespace (its newline) moves to the front of the continuation."""
    stripped = context.rstrip()
    ctx, tgt = TOKENIZER.encode(stripped), TOKENIZER.encode(context[len(stripped):] + target)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ctx + tgt]))[0].float(), dim=-1)
    rows = logprobs[len(ctx) - 1: len(ctx) - 1 + len(tgt)]
    picked = rows[torch.arange(len(tgt)), torch.tensor(tgt)]
    return picked.sum().item(), bool((rows.argmax(-1) == torch.tensor(tgt)).all())


def test_loglikelihood_scores_equal_the_models(evaluated):
    model, docs, results = evaluated
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert len(samples) == DOCS
    want = [in_process_loglikelihood(model, doc["context"], doc["target"]) for doc in docs]
    for sample, (logprob, greedy) in zip(samples, want):
        got_logprob, got_greedy = sample["resps"][0][0]
        assert float(got_logprob) == pytest.approx(logprob, abs=1e-4 * (1 + len(sample["doc"]["target"])))
        assert got_greedy == greedy
    acc = results["results"][TASK]["acc,none"]
    assert acc == pytest.approx(sum(g for _, g in want) / DOCS)
    assert math.isfinite(results["results"][TASK]["perplexity,none"])


def test_greedy_generation_equals_the_engine(evaluated):
    model, docs, results = evaluated
    samples = sorted(results["samples"][f"{TASK}_gen"], key=lambda s: s["doc_id"])
    engine = Engine(model, max_batch=4, max_seq_len=512)
    outs = engine.generate([TOKENIZER.encode(d["context"]) for d in docs],
                           SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=(TOKENIZER.eos_id,)))
    lines = [TOKENIZER.decode(o.token_ids).split("\n")[0] for o in outs]
    assert [s["filtered_resps"][0] for s in samples] == lines
    score = sum(line == doc["target"] for line, doc in zip(lines, docs)) / DOCS
    assert results["results"][f"{TASK}_gen"]["exact_match,none"] == pytest.approx(score)
