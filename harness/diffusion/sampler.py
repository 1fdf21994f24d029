"""LLaDA sampling for a masked diffusion LM: start from prompt + gen_length mask tokens and unmask the answer block
by block, left to right, several tokens per forward pass (LLaDA's semi-autoregressive remasking, Nie et al. 2025),
optionally with Fast-dLLM's approximate caches and confidence-threshold unmasking."""
import time
from dataclasses import dataclass

import torch

from harness.diffusion.cache import CACHES, BlockForward
from harness.diffusion.schedule import transfer_counts

REMASKING = ("low_confidence", "random")


@dataclass
class DiffusionOutput:
    token_ids: list[list[int]]  # the gen_length generated ids of each prompt
    forward_passes: int
    unmasked: list[list[int]]  # [forward][row]: tokens each forward unmasked in each row
    first_block_s: float  # until every row's first block is complete: the analogue of time to first token
    wall_s: float
    cache_bytes: int  # analytic K/V bytes of the positions the approximate cache holds; 0 without a cache
    cache_bytes_allocated: int  # measured: the cache tensors' bytes (rows padded to the longest sequence)

    @property
    def tokens_per_forward(self) -> float:
        """Tokens one forward pass unmasks per sequence (autoregressive decode: 1)."""
        return sum(map(sum, self.unmasked)) / (len(self.token_ids) * self.forward_passes)

    @property
    def tokens_per_second(self) -> float:
        return sum(map(len, self.token_ids)) / self.wall_s

    def agreement(self, other: "DiffusionOutput") -> float:
        """Fraction of generated tokens equal to another run's on the same prompts (an approximate cache against
        no cache, with the same seed)."""
        pairs = [(a, b) for mine, theirs in zip(self.token_ids, other.token_ids, strict=True)
                 for a, b in zip(mine, theirs, strict=True)]
        return sum(a == b for a, b in pairs) / len(pairs)


class DiffusionSampler:
    def __init__(self, model, steps: int, block_length: int, remasking: str = "low_confidence",
                 temperature: float = 0.0, cache: str | None = None, threshold: float | None = None,
                 refresh_every: int | None = None):
        """steps: forward passes over the whole answer, split evenly between its blocks of block_length tokens.
        remasking: which masked positions a step unmasks: the most confident predictions, or random ones.
        temperature: 0 is greedy; above 0, Gumbel-max sampling from softmax(logits / temperature).
        cache: None, "prefix" or "dual" (Fast-dLLM; see harness.diffusion.cache.BlockForward), refreshed at each
        block's first step and, with refresh_every=n, at every n-th step of a block.
        threshold: unmask every masked position of the block whose confidence is >= threshold (at least one per
        step) instead of the schedule's count; a block then takes as many steps as it needs, and `steps` only
        sets the block count rule (steps divisible by gen_length / block_length).
        """
        config = model.config
        if config.causal or getattr(config, "mask_token_id", None) is None:
            raise ValueError(f"model {config.name!r} is not a masked diffusion LM (it needs causal=False and a "
                             f"mask_token_id); build one with zoo.build('diffusion', ...)")
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if block_length < 1:
            raise ValueError(f"block_length must be >= 1, got {block_length}")
        if remasking not in REMASKING:
            raise ValueError(f"unknown remasking {remasking!r}; allowed: {', '.join(REMASKING)}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if cache not in CACHES:
            raise ValueError(f"unknown cache {cache!r}; allowed: {', '.join(map(str, CACHES))}")
        if threshold is not None and not 0 < threshold <= 1:
            raise ValueError(f"threshold must lie in (0, 1] (a softmax probability), got {threshold}")
        if refresh_every is not None and (cache is None or refresh_every < 1):
            raise ValueError(f"refresh_every must be >= 1 and needs a cache ('prefix' or 'dual'), "
                             f"got refresh_every={refresh_every} with cache={cache!r}")
        self.model, self.config = model.eval(), config
        self.steps, self.block_length, self.remasking, self.temperature = steps, block_length, remasking, temperature
        self.cache, self.threshold, self.refresh_every = cache, threshold, refresh_every
        self.device = next(model.parameters()).device

    def check(self, prompts, gen_length: int) -> list[list[int]]:
        """The prompts as lists of ids; every bad setting raises here, before any forward pass."""
        if isinstance(prompts, torch.Tensor):
            if prompts.dim() != 2:
                raise ValueError(f"a prompt tensor must be [batch, prompt_len], got shape {tuple(prompts.shape)}")
            prompts = prompts.tolist()
        prompts = [[int(t) for t in prompt] for prompt in prompts]
        if not prompts:
            raise ValueError("no prompts: generate needs at least one")
        if gen_length < 1 or gen_length % self.block_length:
            raise ValueError(f"gen_length={gen_length} must be a positive multiple of block_length={self.block_length}")
        blocks = gen_length // self.block_length
        if self.steps % blocks:
            raise ValueError(f"steps={self.steps} must be divisible by the number of blocks "
                             f"(gen_length / block_length = {blocks}); allowed: multiples of {blocks}")
        vocab, mask_id, limit = self.config.vocab_size, self.config.mask_token_id, self.config.max_seq_len
        for i, prompt in enumerate(prompts):
            bad = [t for t in prompt if not 0 <= t < vocab or t == mask_id]
            if bad:
                raise ValueError(f"prompt {i} has token id(s) {bad[:5]}: ids must lie in [0, {vocab}) "
                                 f"and differ from the mask token {mask_id}")
            if len(prompt) + gen_length > limit:
                raise ValueError(f"prompt {i} of {len(prompt)} tokens + gen_length={gen_length} exceeds "
                                 f"max_seq_len={limit}")
        return prompts

    @torch.inference_mode()
    def generate(self, prompts: "list[list[int]] | torch.Tensor", gen_length: int,
                 generator: torch.Generator | None = None) -> DiffusionOutput:
        """Fill gen_length tokens after each prompt; generator seeds the Gumbel noise and random remasking."""
        prompts = self.check(prompts, gen_length)
        start = time.perf_counter()
        mask_id, rows = self.config.mask_token_id, len(prompts)
        lengths = [len(prompt) + gen_length for prompt in prompts]
        x = torch.full((rows, max(lengths)), mask_id, device=self.device)  # right padding stays masked and hidden
        for i, prompt in enumerate(prompts):
            x[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        prompt_ends = torch.tensor([len(prompt) for prompt in prompts], device=self.device)
        answer = prompt_ends[:, None] + torch.arange(gen_length, device=self.device)  # each row's own answer positions
        forward = BlockForward(self.model, self.cache, self.refresh_every, lengths)
        steps_per_block = self.steps // (gen_length // self.block_length)
        unmasked, first_block_s = [], None
        for first in range(0, gen_length, self.block_length):
            last = first + self.block_length
            block = answer[:, first:last]
            counts = None if self.threshold is not None else transfer_counts((x.gather(1, block) == mask_id).sum(1),
                                                                             steps_per_block)
            step = 0
            while not self.block_done(x.gather(1, block), step, steps_per_block):
                logits = forward(x, answer, first, last, step)
                tokens, chosen = self.unmask(logits, x.gather(1, block), None if counts is None else counts[:, step],
                                             generator)
                x.scatter_(1, block, tokens)
                unmasked.append(chosen.sum(1).tolist())
                step += 1
            if first_block_s is None:
                first_block_s = time.perf_counter() - start
        token_ids = [x[i, len(prompt) : len(prompt) + gen_length].tolist() for i, prompt in enumerate(prompts)]
        return DiffusionOutput(token_ids, len(unmasked), unmasked, first_block_s, time.perf_counter() - start,
                               forward.cache_bytes, forward.cache_bytes_allocated)

    def block_done(self, tokens: torch.Tensor, step: int, steps_per_block: int) -> bool:
        """The schedule's steps are spent; with a threshold, no mask is left in the block [B, L]."""
        if self.threshold is None:
            return step == steps_per_block
        return not bool((tokens == self.config.mask_token_id).any())

    def unmask(self, logits: torch.Tensor, tokens: torch.Tensor, k: torch.Tensor | None, generator):
        """logits [B, L, V] and tokens [B, L] of the block; k [B] tokens to unmask (None: by threshold).
        Returns the block's new tokens and which positions this step unmasked; unmasked tokens never change."""
        masked = tokens == self.config.mask_token_id
        # a prediction is a token, never "still masked" (out of place: the logits may be the caller's tensor)
        mask_column = torch.tensor([self.config.mask_token_id], device=logits.device)
        logits = logits.float().index_fill(-1, mask_column, float("-inf"))
        x0 = self.predict(logits, generator)
        if self.remasking == "low_confidence":
            confidence = logits.softmax(-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
        else:
            confidence = torch.rand(tokens.shape, generator=generator, device=tokens.device)
        confidence = confidence.masked_fill(~masked, float("-inf"))
        if k is None:
            chosen = confidence >= self.threshold
            rows = torch.arange(len(chosen), device=chosen.device)
            chosen[rows, confidence.argmax(1)] = True  # at least one (cleared below in a row with no mask left)
        else:
            order = confidence.argsort(dim=1, descending=True, stable=True)  # ties: the leftmost first
            top_k = torch.arange(order.shape[1], device=order.device) < k[:, None]  # [B, L]: rank r is among the top k
            chosen = torch.zeros_like(masked).scatter_(1, order, top_k)
        chosen &= masked
        return torch.where(chosen, x0, tokens), chosen

    def predict(self, logits: torch.Tensor, generator) -> torch.Tensor:
        """x0: the argmax, or with temperature > 0 a sample by the Gumbel-max trick (in float64: LLaDA notes that
        low-precision Gumbel noise degrades generation)."""
        if self.temperature == 0:
            return logits.argmax(-1)
        u = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device=logits.device)
        return (logits.double() / self.temperature - torch.log(-torch.log(u))).argmax(-1)
