"""Beam search on shared blocks equals transformers' generate(num_beams=...) on the same weights, in fp32: the same
hypotheses in the same order with the same scores, for Llama (full attention), Mistral (a sliding window) and Mamba
(a recurrent state copied on fork), across num_beams, length_penalty and early_stopping. Bad parameters are clear
errors before any work, and the engine's pool is whole again afterwards."""
import pytest
import torch
from transformers import LlamaForCausalLM, MambaForCausalLM, MistralForCausalLM

from harness import BeamSearchParams, Engine, SamplingParams
from test_hf_parity import VOCAB, llama_config, mistral_config, random_hf  # tests/ is on sys.path under pytest
from test_mamba import random_hf_mamba
from zoo.hf import from_hf

PROMPT_LEN, NEW_TOKENS, PAD = 12, 10, VOCAB - 1
BLOCK_SIZE = 4  # beams fork mid-block, so their first writes copy a shared block


def hf_model(kind: str):
    if kind == "llama":
        return random_hf(LlamaForCausalLM, llama_config(), seed=3)
    if kind == "mistral":
        return random_hf(MistralForCausalLM, mistral_config(sliding_window=6), seed=4)
    return random_hf_mamba(seed=5)


@pytest.fixture(scope="module", params=["llama", "mistral", "mamba"])
def pair(request):
    hf = hf_model(request.param)
    return request.param, hf, from_hf(hf).eval()


def prompt(seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB - 1, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_beams(hf, ids: list[int], params: BeamSearchParams) -> list[tuple[list[int], float | None]]:
    """transformers' hypotheses: tokens (padding cut) and sequences_scores (none for one beam: greedy)."""
    out = hf.generate(torch.tensor([ids]), num_beams=params.num_beams, max_new_tokens=params.max_new_tokens,
                      length_penalty=params.length_penalty, early_stopping=params.early_stopping,
                      num_return_sequences=params.num_return_sequences, eos_token_id=list(params.stop_token_ids),
                      pad_token_id=PAD, do_sample=False, return_dict_in_generate=True, output_scores=True)
    scores = out.sequences_scores.tolist() if params.num_beams > 1 else [None]
    beams = []
    for row, score in zip(out.sequences[:, len(ids):].tolist(), scores):
        while row and row[-1] == PAD:
            row.pop()
        beams.append((row, score))
    return beams


def stop_ids(hf, ids: list[int]) -> tuple[int, ...]:
    """Two ids that the model's own 4-beam search produces early, so hypotheses end at different lengths."""
    tokens = hf_beams(hf, ids, BeamSearchParams(num_beams=4, max_new_tokens=NEW_TOKENS, num_return_sequences=4))
    return tuple(dict.fromkeys([tokens[0][0][2], tokens[1][0][4]]))


CASES = [
    dict(num_beams=1),
    dict(num_beams=2, length_penalty=1.5, early_stopping=True),
    dict(num_beams=2, length_penalty=0.5, early_stopping=False, num_return_sequences=2),
    dict(num_beams=4, length_penalty=2.0, early_stopping=False, num_return_sequences=3),
    dict(num_beams=4, length_penalty=-0.5, early_stopping=True, num_return_sequences=4),
    dict(num_beams=4, length_penalty=1.2, early_stopping="never", num_return_sequences=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_beam_search_equals_transformers(pair, case):
    kind, hf, model = pair
    ids = prompt()
    params = BeamSearchParams(max_new_tokens=NEW_TOKENS, stop_token_ids=stop_ids(hf, ids), **case)
    engine = Engine(model, max_batch=4, max_seq_len=64, kv_cache="paged", block_size=BLOCK_SIZE)
    got = engine.beam_search(ids, params)
    want = hf_beams(hf, ids, params)
    assert [beam.token_ids for beam in got] == [tokens for tokens, _ in want], f"{kind} {case}"
    if params.num_beams > 1 and params.length_penalty <= 0.5:  # short hypotheses favoured: a stop id must show
        assert any(beam.token_ids[-1] in params.stop_token_ids for beam in got), f"{kind} {case}: none ended early"
    for beam, (_, score) in zip(got, want):
        if score is not None:
            assert beam.score == pytest.approx(score, abs=1e-4), f"{kind} {case}"
    for manager in engine.block_managers:  # every beam gave its blocks back
        assert manager.num_free == manager.num_blocks and not manager.tables and manager.reserved == 0
    assert len(engine.scheduler.free_slots) == engine.max_batch


@pytest.mark.parametrize("kind", ["llama", "mistral"])  # Mamba has no blocks: its state rows are copied on fork
def test_beams_share_blocks_and_copy_on_write(kind):
    """Forked beams hold their parent's blocks by reference: mid-search, fewer blocks are in use than the beams' tables
    name, and at least one copy-on-write happened."""
    engine = Engine(from_hf(hf_model(kind)).eval(), max_batch=4, max_seq_len=64, kv_cache="paged",
                    block_size=BLOCK_SIZE)
    manager, seen = engine.block_managers[0], {"shared": 0, "copies": 0}
    grow = manager.grow

    def watch(seq, length, first=None):
        grow(seq, length, first)
        seen["copies"] += len(manager.copies)
        named = sum(block >= 0 for table in manager.tables.values() for block in table)
        seen["shared"] = max(seen["shared"], named - manager.used)

    manager.grow = watch
    engine.beam_search(prompt(), BeamSearchParams(num_beams=4, max_new_tokens=NEW_TOKENS))
    assert seen["shared"] > 0 and seen["copies"] > 0, seen


@pytest.mark.parametrize("bad, match", [
    (dict(num_beams=0), "num_beams must be"),
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
    (dict(early_stopping="sometimes"), "early_stopping must be True, False or 'never'"),
    (dict(length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(max_new_tokens=0), "max_new_tokens must be"),
])
def test_bad_beam_parameters_are_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**bad)


def test_beam_search_refuses_what_it_cannot_serve(pair):
    kind, hf, model = pair
    ids = prompt()
    with pytest.raises(ValueError, match="needs a batch slot per beam"):
        Engine(model, max_batch=2, max_seq_len=64, kv_cache="paged").beam_search(ids, BeamSearchParams(num_beams=4))
    with pytest.raises(ValueError, match="needs kv_cache='paged'"):
        Engine(model, max_batch=4, max_seq_len=64).beam_search(ids, BeamSearchParams(num_beams=4))
    with pytest.raises(ValueError, match="out of vocabulary"):
        Engine(model, max_batch=4, max_seq_len=64, kv_cache="paged").beam_search(
            ids, BeamSearchParams(num_beams=2, stop_token_ids=(VOCAB + 3,)))
    busy = Engine(model, max_batch=4, max_seq_len=64, kv_cache="paged")
    busy.add_request(ids, SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="needs an idle engine"):
        busy.beam_search(ids, BeamSearchParams(num_beams=2))
    if busy.block_managers:
        small = Engine(model, max_batch=4, max_seq_len=64, kv_cache="paged", block_size=BLOCK_SIZE, num_blocks=8)
        with pytest.raises(ValueError, match="4 beams may need"):
            small.beam_search(ids, BeamSearchParams(num_beams=4, max_new_tokens=NEW_TOKENS))
