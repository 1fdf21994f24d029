"""Beam search on the engine's paged cache: beams fork by reference (every block shared), diverge by copy-on-write
(the first write into a shared block copies it), and are pruned by returning their blocks; a recurrent state's row is
copied on fork. The scoring is Hugging Face transformers' beam search, step for step, so the same weights give the
same beams:

- each step, every running beam's log-softmax plus its score; the best K = max(2, 1 + #stop ids) * num_beams
  (beam, token) candidates over all beams;
- the num_beams best candidates that do not end (a stop id, or max_new_tokens reached) run on;
- a candidate among the first num_beams that ends is a finished hypothesis with score sum / generated ** length_penalty,
  kept if it is among the num_beams best finished so far;
- early_stopping=True stops once num_beams hypotheses are finished; False stops when the best running beam, scored
  at its current length, cannot beat the worst finished one; "never" scores it at max_new_tokens when length_penalty
  > 0 (the canonical bound).
"""
from dataclasses import dataclass

import torch

from harness.engine.sampling import MAX_STOP_TOKEN_IDS, SamplingParams
from harness.engine.sequence import Sequence
from zoo import checks

NO_HOPE = -1.0e9  # the score transformers gives an impossible candidate


@dataclass(frozen=True)
class BeamSearchParams:
    num_beams: int = 4
    max_new_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        """Types and ranges; values are normalised (numpy ints become ints, a stop id list a tuple)."""
        num_beams = checks.integer("num_beams", self.num_beams, minimum=1)
        checked = {
            "num_beams": num_beams,
            "max_new_tokens": checks.integer("max_new_tokens", self.max_new_tokens, minimum=1),
            "length_penalty": checks.real("length_penalty", self.length_penalty),
            "early_stopping": early_stopping(self.early_stopping),
            "num_return_sequences": checks.integer(f"num_return_sequences (num_beams={num_beams} at most)",
                                                   self.num_return_sequences, 1, num_beams),
            "stop_token_ids": checks.id_tuple("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)


def early_stopping(value) -> "bool | str":
    """True, False or "never", the string compared by value: one read from JSON is another object than the literal
    (and 1 or 0, equal to True and False, are refused: the search tests `is True`)."""
    if isinstance(value, bool) or (isinstance(value, str) and value == "never"):
        return value
    raise ValueError(f"early_stopping must be True, False or 'never', got {checks.short(value)}")


@dataclass
class BeamOutput:
    token_ids: list[int]
    score: float  # sum of log-probabilities / generated tokens ** length_penalty


class BeamSearch:
    """One prompt's beam search on an idle engine, which lends its slots, block managers, runner and pool."""

    def __init__(self, engine, prompt_ids: list[int], params: BeamSearchParams):
        self.engine, self.params = engine, params
        self.next_id = -1  # beams are not requests: negative ids stay clear of the engine's
        self.sampling = SamplingParams(max_new_tokens=params.max_new_tokens, temperature=0.0)  # sizes each beam's cache
        self.root = self.new_sequence(prompt_ids, [])
        self.live = [self.root]  # the beams holding slots and blocks, released when the search ends
        self.stops = torch.tensor(params.stop_token_ids, dtype=torch.long)

    def new_sequence(self, prompt_ids: list[int], output_ids: list[int]) -> Sequence:
        seq = Sequence(self.next_id, prompt_ids, self.sampling, None, output_ids=output_ids)
        self.next_id -= 1
        seq.slot = self.engine.scheduler.free_slots.popleft()
        return seq

    def run(self) -> list[BeamOutput]:
        p, engine = self.params, self.engine
        for manager in engine.block_managers:
            manager.admit(self.root, len(self.root.prompt_ids))
        beams = [self.root] * p.num_beams  # transformers starts from num_beams copies, all but the first at NO_HOPE
        try:
            logits = engine.runner.prefill([(self.root, len(self.root.prompt_ids))]).expand(p.num_beams, -1)
            return self.search(beams, logits) if p.num_beams > 1 else self.greedy(logits)
        finally:
            for seq in {id(s): s for s in self.live}.values():
                self.release(seq)

    def search(self, beams: list[Sequence], logits: torch.Tensor) -> list[BeamOutput]:
        p = self.params
        # transformers' candidate count, at most every (beam, token) pair: many stop ids must not outnumber them
        keep = min(max(2, 1 + len(p.stop_token_ids)) * p.num_beams, p.num_beams * logits.shape[-1])
        first_beams = torch.arange(keep) < p.num_beams  # only these may end as hypotheses
        running = torch.full((p.num_beams,), NO_HOPE)
        running[0] = 0.0
        finished = torch.full((p.num_beams,), NO_HOPE)
        finished_done = torch.zeros(p.num_beams, dtype=torch.bool)
        finished_tokens: list[list[int]] = [[] for _ in range(p.num_beams)]
        hopeful = True  # can a running beam still beat the worst finished hypothesis?
        for generated in range(1, p.max_new_tokens + 1):
            vocab = logits.shape[-1]
            scores = (torch.log_softmax(logits.float(), dim=-1) + running[:, None]).reshape(-1)
            top_scores, top = torch.topk(scores, keep)
            parents, tokens = (top // vocab).tolist(), top % vocab
            ends = torch.isin(tokens, self.stops) | (generated >= p.max_new_tokens)
            # the num_beams best candidates that go on
            go_on = torch.topk(top_scores + ends.float() * NO_HOPE, p.num_beams).indices
            # hypotheses: merge the ending candidates with the finished ones, keep the num_beams best
            ended = ends & first_beams
            final = top_scores / (generated ** p.length_penalty)
            final = final + float(bool(finished_done.all()) and p.early_stopping is True) * NO_HOPE
            final = final + float(not hopeful) * NO_HOPE
            final = final + (~ended).float() * NO_HOPE
            candidates = [beams[parent].output_ids + [token] for parent, token in zip(parents, tokens.tolist())]
            best = torch.topk(torch.cat([finished, final]), p.num_beams).indices.tolist()
            pool_tokens = finished_tokens + candidates
            pool_done = torch.cat([finished_done, ended])
            finished = torch.cat([finished, final])[best]
            finished_done, finished_tokens = pool_done[best], [pool_tokens[i] for i in best]
            running = (top_scores + ends.float() * NO_HOPE)[go_on]
            # stop rules, as transformers checks them after each step
            length = (p.max_new_tokens if p.early_stopping == "never" and p.length_penalty > 0 else generated)
            worst = torch.where(finished_done, finished.min(), NO_HOPE)
            hopeful = hopeful and bool((running[0] / (length ** p.length_penalty) > worst).any())
            if not hopeful or (finished_done.all() and p.early_stopping is True) or ends.all():
                break
            beams = self.advance(beams, [(parents[i], tokens[i].item()) for i in go_on.tolist()])
            logits = self.engine.runner.decode(beams)
        return [BeamOutput(finished_tokens[i], finished[i].item()) for i in range(p.num_return_sequences)]

    def greedy(self, logits: torch.Tensor) -> list[BeamOutput]:
        """One beam is greedy search (transformers switches to it too): the argmax until a stop id or the length."""
        p, seq, total = self.params, self.root, 0.0
        for generated in range(1, p.max_new_tokens + 1):
            log_probs = torch.log_softmax(logits[0].float(), dim=-1)
            token = int(log_probs.argmax())
            total += log_probs[token].item()
            seq.output_ids.append(token)
            if token in p.stop_token_ids or generated == p.max_new_tokens:
                return [BeamOutput(list(seq.output_ids), total / generated ** p.length_penalty)]
            logits = self.engine.runner.decode([seq])

    def advance(self, beams: list[Sequence], chosen: list[tuple[int, int]]) -> list[Sequence]:
        """The next beams: a parent chosen once continues itself, chosen again it forks (blocks shared, state row
        copied); a parent not chosen returns its blocks and slot."""
        kept = {id(beams[parent]) for parent, _ in chosen}
        for seq in {id(s): s for s in beams}.values():
            if id(seq) not in kept:
                self.release(seq)
        claimed, nexts = set(), []
        for parent, _ in chosen:
            seq = beams[parent]
            nexts.append(self.fork(seq) if id(seq) in claimed else seq)
            claimed.add(id(seq))
        for seq, (_, token) in zip(nexts, chosen):  # after every fork: a child copies its parent's tokens so far
            seq.output_ids.append(token)
        self.live = nexts
        return nexts

    def fork(self, parent: Sequence) -> Sequence:
        child = self.new_sequence(parent.prompt_ids, list(parent.output_ids))
        child.num_cached, child.digests = parent.num_cached, list(parent.digests)
        for manager in self.engine.block_managers:
            manager.fork(parent, child)
        self.engine.pool.copy_state(parent.slot, child.slot)
        return child

    def release(self, seq: Sequence) -> None:
        for manager in self.engine.block_managers:
            if seq.request_id in manager.tables:
                manager.release(seq)
        if seq.slot >= 0:
            self.engine.scheduler.free_slots.append(seq.slot)
            seq.slot = -1
