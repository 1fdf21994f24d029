"""Random programs of add_request / step / abort (of running, waiting and ended requests) on a small paged pool, with
worst-case or optimistic admission (the second preempts), prompts whole or chunked under a token budget. After
every call the engine's books must balance: every block is free or held by one running request, ended requests hold
nothing, batch slots are conserved. Every ended request has its requested length or stop reason, and a greedy one the
tokens it gets alone (under eviction by score, one that was never preempted: a recomputed prefill keeps by the
whole prompt's scores, not the ones its decode steps built up). With token trees (two drafts, one of them the target
itself, so some steps accept a branch whose rows must move and others reject every branch) the same books balance:
rejected branches leave no rows and no blocks behind."""
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import zoo
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from harness import Engine, SamplingParams, SpeculativeConfig
from harness.engine.sequence import Status
from helpers import make_prompts, random_model  # tests/ is on sys.path under pytest

# one cache group; a sliding-window group beside a global one; state slots only; gqa evicting by score (H2O); gqa
# verifying token trees
ARCHS = ["gqa", "hybrid", "mamba", "gqa-h2o", "gqa-tree"]
VOCAB = 512  # the tiny preset's
MAX_SEQ_LEN, BLOCK_SIZE, MAX_BATCH = 64, 4, 3
PROMPT_LENGTHS = (1, 3, 4, 7, 12, 20, 33)  # 33 + 6 new tokens need 10 blocks: the smallest pool holds one at a time
MAX_NEW_TOKENS = 6
# Derandomized (the seed comes from the test's source) and no example database: every CI run tries the same programs.
# Hypothesis' caches and failure patches go to the temp directory, not into the checkout.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "archzoo-hypothesis")
PROGRAMS = settings(max_examples=200, stateful_step_count=20, deadline=None, database=None, derandomize=True)


@dataclass(frozen=True)
class Workload:
    model: object
    prompts: list[list[int]]
    alone: list[list[int]]  # each prompt's greedy MAX_NEW_TOKENS tokens from an engine serving it alone
    speculative: SpeculativeConfig | None = None


@pytest.fixture(scope="module", params=ARCHS)
def workload(request) -> Workload:
    arch, _, policy = request.param.partition("-")
    model = random_model(arch, max_seq_len=MAX_SEQ_LEN)
    speculative = None
    if policy == "tree":  # a random draft's chain and the target's own: a tree whose second branch is accepted
        speculative = SpeculativeConfig((random_model(arch, seed=9), random_model(arch, max_seq_len=MAX_SEQ_LEN)),
                                        num_speculative_tokens=2)
    elif policy:  # 10 tokens a sequence, 4 of them the newest: prompts and outputs run past it
        model = zoo.evict(model, policy=policy, budget=10, window=4)
    prompts = make_prompts(PROMPT_LENGTHS, VOCAB, seed=7)
    greedy = SamplingParams(MAX_NEW_TOKENS, temperature=0.0)
    alone = [Engine(model, max_batch=1, max_seq_len=MAX_SEQ_LEN).generate([p], greedy)[0].token_ids for p in prompts]
    return Workload(model, prompts, alone, speculative)


def greedy_tokens(alone: list[int], params: SamplingParams) -> list[int]:
    """What a greedy request gives: the prompt's tokens alone, cut at its length or its first stop id."""
    tokens = alone[:params.max_new_tokens]
    stops = [i for i, token in enumerate(tokens) if token in params.stop_token_ids]
    return tokens[:stops[0] + 1] if stops else tokens


def books(engine: Engine) -> tuple:
    """The ids issued, the live requests, the steps run and the free blocks."""
    return (engine.requests_added, sorted(engine.unfinished), engine.decode_stats.steps,
            [(list(m.free), m.reserved) for m in engine.block_managers])


class EngineProgram(RuleBasedStateMachine):
    def __init__(self, workload: Workload):
        super().__init__()
        self.workload = workload
        self.params: dict[int, SamplingParams] = {}
        self.prompt_of: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}  # streamed so far, by request id
        self.live: set[int] = set()
        self.ended: set[int] = set()

    @initialize(num_blocks=st.integers(10, 16), admission=st.sampled_from(["reserve", "optimistic"]),
                budget=st.sampled_from([None, 1, 5]))
    def make_engine(self, num_blocks, admission, budget):
        # optimistic admission into these pools preempts: a preempted request must still end with its alone tokens;
        # a token budget splits prompts over steps (chunked prefill), preempted part-way through or not
        self.scored = "score" in self.workload.model.config.layers[0].params  # a prompt is scored whole: no budget
        lookahead = 0 if self.workload.speculative is None else self.workload.speculative.width
        self.engine = Engine(self.workload.model, max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN, kv_cache="paged",
                             block_size=BLOCK_SIZE, num_blocks=num_blocks + -(-lookahead // BLOCK_SIZE),
                             admission=admission,
                             max_num_batched_tokens=None if self.scored else budget,
                             speculative=self.workload.speculative)

    # ---- the program's calls ----------------------------------------------------------------------------

    @rule(prompt=st.integers(0, len(PROMPT_LENGTHS) - 1), max_new_tokens=st.integers(1, MAX_NEW_TOKENS),
          sampled=st.booleans(), stop_at=st.none() | st.integers(0, MAX_NEW_TOKENS - 1))
    def add(self, prompt, max_new_tokens, sampled, stop_at):
        # a stop id the greedy continuation reaches, so "stop" happens
        stops = () if stop_at is None else (self.workload.alone[prompt][stop_at],)
        params = SamplingParams(max_new_tokens, temperature=0.8 if sampled else 0.0, seed=len(self.params),
                                stop_token_ids=stops)
        request_id = self.engine.add_request(self.workload.prompts[prompt], params)
        self.params[request_id], self.prompt_of[request_id], self.tokens[request_id] = params, prompt, []
        self.live.add(request_id)

    @rule()
    def add_longer_than_max_seq_len(self):
        self.check_refused([1] * (MAX_SEQ_LEN - 2), SamplingParams(3, temperature=0.0))

    @precondition(lambda self: self.engine.block_managers and not self.scored)  # evicting, any length fits
    @rule()
    def add_more_than_the_pool_holds(self):
        blocks = self.engine.block_managers[0].num_blocks
        self.check_refused([1] * (BLOCK_SIZE * blocks - 1), SamplingParams(3, temperature=0.0))  # caches blocks + 1

    @rule()
    def step(self):
        for event in self.engine.step_tokens():
            self.tokens[event.request_id].append(event.token_id)
            if event.finished is not None:
                self.check_completed(event.finished)

    @precondition(lambda self: self.engine.scheduler.running)
    @rule(pick=st.integers(0, MAX_BATCH - 1))
    def abort_running(self, pick):
        running = self.engine.scheduler.running
        self.check_aborted(self.engine.abort(running[pick % len(running)].request_id))

    @precondition(lambda self: self.engine.scheduler.waiting)
    @rule(pick=st.integers(0, 7))
    def abort_waiting(self, pick):
        waiting = self.engine.scheduler.waiting
        output = self.engine.abort(waiting[pick % len(waiting)].request_id)
        assert output.token_ids == []
        self.check_aborted(output)

    @precondition(lambda self: self.ended)
    @rule(pick=st.integers(0, 7))
    def abort_ended(self, pick):
        ended = sorted(self.ended)
        assert self.engine.abort(ended[pick % len(ended)]) is None

    @rule(beyond=st.integers(0, 3))
    def abort_unknown(self, beyond):
        with pytest.raises(ValueError, match="unknown request_id"):
            self.engine.abort(self.engine.requests_added + beyond)

    def teardown(self):
        """Every live request runs to its end within its steps (a chunked prompt takes up to one a token), and the
        pool is whole again."""
        for _ in range((MAX_NEW_TOKENS + max(PROMPT_LENGTHS)) * len(self.live)):
            self.step()
        assert not self.live and not self.engine.has_unfinished()
        for manager in self.engine.block_managers:
            assert sorted(manager.free) == list(range(manager.num_blocks)) and manager.reserved == 0

    # ---- what ended requests return, what refused ones leave ----------------------------------------------

    def end(self, request_id: int) -> None:
        assert request_id in self.live, f"request {request_id} ended twice or was never added"
        self.live.remove(request_id)
        self.ended.add(request_id)

    def check_completed(self, output) -> None:
        params = self.params[output.request_id]
        tokens = output.token_ids
        assert tokens == self.tokens[output.request_id]
        assert output.finish_reason in ("length", "stop"), f"{output.finish_reason}: {output.error}"
        assert not set(params.stop_token_ids).intersection(tokens[:-1])
        if output.finish_reason == "stop":
            assert 1 <= len(tokens) <= params.max_new_tokens and tokens[-1] in params.stop_token_ids
        else:
            assert len(tokens) == params.max_new_tokens and tokens[-1] not in params.stop_token_ids
        if params.greedy and not (self.scored and output.preemptions):
            assert tokens == greedy_tokens(self.workload.alone[self.prompt_of[output.request_id]], params)
        self.end(output.request_id)

    def check_aborted(self, output) -> None:
        assert output.finish_reason == "abort" and output.token_ids == self.tokens[output.request_id]
        self.end(output.request_id)

    def check_refused(self, prompt: list[int], params: SamplingParams) -> None:
        """Refused with ValueError, leaving the queue, the step count and the pool as they were."""
        before = books(self.engine)
        with pytest.raises(ValueError):
            self.engine.add_request(prompt, params)
        assert books(self.engine) == before

    # ---- the books balance after every call ---------------------------------------------------------------

    @invariant()
    def every_block_is_free_or_held_once_by_a_running_request(self):
        running = self.engine.scheduler.running
        for manager in self.engine.block_managers:
            assert set(manager.tables) == {seq.request_id for seq in running}
            held = [block for table in manager.tables.values() for block in table if block >= 0]
            assert len(manager.free) + len(held) == manager.num_blocks
            assert sorted(held + list(manager.free)) == list(range(manager.num_blocks))
            # reserve: the running requests' peaks fit the pool, so what each still needs is there to take;
            # optimistic reserves nothing (it preempts instead)
            if manager.optimistic:
                assert manager.reserved == 0
            else:
                assert manager.reserved == sum(manager.peak_blocks(s.max_length) for s in running) <= manager.num_blocks
                assert sum(manager.peak_blocks(s.max_length) - manager.held(s) for s in running) <= len(manager.free)

    @invariant()
    def ended_requests_hold_nothing(self):
        scheduler = self.engine.scheduler
        waiting = {seq.request_id for seq in scheduler.waiting}
        running = {seq.request_id for seq in scheduler.running}
        tables = {request_id for manager in self.engine.block_managers for request_id in manager.tables}
        assert self.ended.isdisjoint(waiting | running | tables | set(self.engine.unfinished))
        assert not waiting & running and waiting | running == self.live == set(self.engine.unfinished)
        assert all(seq.status is Status.WAITING for seq in scheduler.waiting)
        assert all(seq.status is Status.RUNNING for seq in scheduler.running)

    @invariant()
    def every_batch_slot_is_free_or_held_once(self):
        scheduler = self.engine.scheduler
        assert len(scheduler.free_slots) + len(scheduler.running) == MAX_BATCH
        slots = [seq.slot for seq in scheduler.running] + list(scheduler.free_slots)
        assert sorted(slots) == list(range(MAX_BATCH))


def test_random_programs_keep_the_books(workload):
    run_state_machine_as_test(lambda: EngineProgram(workload), settings=PROGRAMS)
