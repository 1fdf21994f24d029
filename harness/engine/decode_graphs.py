"""CUDA-graph decode: the decode step captured once per batch-size bucket and replayed.

A decode step of a small model is hundreds of kernel launches; on a GPU their launch cost (microseconds each) exceeds
the time to stream the weights, so every architecture would measure the launches. vLLM, SGLang and nano-vllm capture
the step in a CUDA graph per batch-size bucket and replay it; so does this. What capture needs:

- every per-step input lives in a static buffer (token ids, positions, lengths, slots, block tables, slot
  mappings), written before each replay; a batch of n sequences is padded to its bucket with padding rows;
- the step's shapes are fixed: block tables as wide as max_seq_len needs, attention over the whole cache span;
- the step never synchronises with the host (no .item(), no data-dependent shapes, no tensors built from Python
  data), so capture records it and replay needs no CPU work beyond the buffer copies.

A padding row feeds token 0 at position 0 with length 1, and every cache it reads or writes is one no sequence owns:
the pool's spare slot (a contiguous row, a recurrent state) and each paged group's spare block (its one key). So a
padding row never touches a real sequence's cache, and no slot mapping of the step is -1: a one-byte cache writes
its rows without first selecting the kept ones (a host synchronisation). Its logits are dropped.

"static" mode (any device) runs the same padded step on the same buffers eagerly, without capture: what the tests
check on CPU (stable buffers, no host synchronisation, tokens equal to the plain step's).
"""
import warnings
from dataclasses import dataclass

import torch

from cache import CacheBatch

GRAPH_MODES = ("capture", "static")
WARMUP_STEPS = 2  # before capture: Triton compiles its kernels and cuBLAS picks its algorithms on the first calls


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a graph of their own: 1, 2, 4, 8, 16, then every multiple of 16 (as vLLM pads), up to and
    including max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


@dataclass
class StepRows:
    """One decode step's inputs as host data, one entry per sequence (a padding row is added by the buffers)."""

    tokens: list[int]
    positions: list[int]
    lengths: list[int]
    slots: list[int]
    tables: list[list[list[int]]]  # per cache group, each sequence's block table row
    mappings: list[list[int]]  # per cache group, each sequence's flat pool slot for its new token


class StaticInputs:
    """The decode step's inputs in buffers allocated once for the largest bucket, with a pinned host copy of each:
    a step writes the host copies, then one non-blocking copy per buffer moves them, so replay reads new values
    from the same addresses."""

    def __init__(self, rows: int, table_widths: list[int], pad_slot: int, pad_blocks: list[int], block_size: int,
                 device: torch.device):
        """pad_slot, pad_blocks: the spare slot and each paged group's spare block, which padding rows use."""
        self.pad_slot, self.pad_blocks, self.block_size = pad_slot, pad_blocks, block_size
        pinned = device.type == "cuda"

        def pair(shape, dtype):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pinned)
            return host, torch.zeros(shape, dtype=dtype, device=device)

        self.buffers = {"tokens": pair((rows, 1), torch.int64), "positions": pair((rows, 1), torch.int64),
                        "lengths": pair((rows,), torch.int32), "slots": pair((rows,), torch.int64)}
        for g, width in enumerate(table_widths):
            self.buffers[f"table{g}"] = pair((rows, width), torch.int32)
            self.buffers[f"mapping{g}"] = pair((rows,), torch.int64)
        self.groups = len(table_widths)
        self.written_tables = [[None] * rows for _ in table_widths]  # per group, the table each host row holds
        # the pinned host copies are rewritten only once the previous step's copies out of them have run
        self.copied = torch.cuda.Event() if pinned else None

    @property
    def nbytes(self) -> int:
        """Device bytes of the buffers (their pinned host copies not counted)."""
        return sum(device.nbytes for _, device in self.buffers.values())

    def device(self, name: str, rows: int) -> torch.Tensor:
        return self.buffers[name][1][:rows]

    def batch(self, rows: int, max_length: int) -> CacheBatch:
        """The CacheBatch a bucket's step reads: views of the buffers' first `rows` rows, the same every step."""
        return CacheBatch(positions=self.device("positions", rows), lengths=self.device("lengths", rows),
                          max_length=max_length, step="decode", slots=self.device("slots", rows),
                          block_tables=tuple(self.device(f"table{g}", rows) for g in range(self.groups)),
                          slot_mappings=tuple(self.device(f"mapping{g}", rows) for g in range(self.groups)),
                          every_token_kept=True, captured=True)

    def write(self, step: StepRows | None, rows: int) -> None:
        """Fill the first `rows` rows: the step's sequences, then padding rows (all padding without a step)."""
        n = 0 if step is None else len(step.tokens)
        if self.copied is not None:
            self.copied.synchronize()
        host = {name: pair[0] for name, pair in self.buffers.items()}
        padding_values = {"tokens": 0, "positions": 0, "lengths": 1, "slots": self.pad_slot}
        for name, padding in padding_values.items():
            values = host[name].numpy().reshape(-1)
            values[:n] = [] if step is None else getattr(step, name)
            values[n:rows] = padding
        for g in range(self.groups):
            table, written = host[f"table{g}"].numpy(), self.written_tables[g]
            for i in range(n):
                row = step.tables[g][i]
                if written[i] != row:  # a table changes once a block: rewriting every row cost ~0.1 ms each
                    table[i] = -1
                    table[i, :len(row)] = row
                    written[i] = list(row)
            table[n:rows] = -1
            table[n:rows, 0] = self.pad_blocks[g]  # a padding row's one key: the first of the spare block
            written[n:rows] = [None] * (rows - n)
            mapping = host[f"mapping{g}"].numpy()
            mapping[:n] = [] if step is None else step.mappings[g]
            mapping[n:rows] = self.pad_blocks[g] * self.block_size
        for host_buffer, device_buffer in self.buffers.values():
            device_buffer[:rows].copy_(host_buffer[:rows], non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class DecodeGraphs:
    """The decode step per bucket: captured in a CUDA graph ("capture") or run eagerly on the same static buffers
    ("static"). Buckets are captured on first use; all share one memory pool."""

    def __init__(self, forward, layers: list, max_batch: int, max_length: int, table_widths: list[int],
                 pad_slot: int, pad_blocks: list[int], block_size: int, device: torch.device, mode: str):
        self.forward, self.layers, self.max_length, self.mode = forward, layers, max_length, mode
        self.buckets = batch_buckets(max_batch)
        self.inputs = StaticInputs(self.buckets[-1], table_widths, pad_slot, pad_blocks, block_size, device)
        self.steps: dict[int, tuple] = {}  # bucket -> (graph or None, its CacheBatch, its logits or None)
        self.memory_pool = torch.cuda.graph_pool_handle() if mode == "capture" else None
        self.pool_bytes = 0  # device memory the captured graphs reserved
        self.failure = ""  # why capture failed: every bucket then runs in "static" mode

    @property
    def nbytes(self) -> int:
        """Device bytes the graphs hold: their memory pool and the static input buffers."""
        return self.pool_bytes + self.inputs.nbytes

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, step: StepRows) -> torch.Tensor:
        """Logits [n, vocab] of the step's n sequences."""
        n = len(step.tokens)
        rows = self.bucket(n)
        if rows not in self.steps:
            self.steps[rows] = self.prepare(rows)
        graph, batch, logits = self.steps[rows]
        self.inputs.write(step, rows)
        if graph is None:
            logits = self.forward(self.inputs.device("tokens", rows), batch.positions, self.layers, batch)
        else:
            graph.replay()
        return logits[:n, -1]

    def prepare(self, rows: int) -> tuple:
        """A bucket's (graph or None, CacheBatch, logits or None). A capture that fails leaves every bucket eager on
        the static buffers, with a warning and the reason in `failure`, so the requests go on."""
        if self.mode == "capture":
            try:
                return self.capture(rows)
            except Exception as error:  # noqa: BLE001 - any capture failure falls back to the eager step
                self.failure = f"capture of the batch-{rows} decode step failed: {type(error).__name__}: {error}"
                warnings.warn(f"CUDA graphs off: {self.failure}", RuntimeWarning, stacklevel=3)
                self.mode, self.steps = "static", {}
        return None, self.inputs.batch(rows, self.max_length), None

    def capture(self, rows: int) -> tuple:
        """Warm the bucket's step up on a side stream, then capture it; every row is padding meanwhile, so neither
        writes into a sequence's cache."""
        batch = self.inputs.batch(rows, self.max_length)
        tokens = self.inputs.device("tokens", rows)
        self.inputs.write(None, rows)
        reserved = torch.cuda.memory_reserved()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.forward(tokens, batch.positions, self.layers, batch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            logits = self.forward(tokens, batch.positions, self.layers, batch)
        torch.cuda.synchronize()
        self.pool_bytes += max(0, torch.cuda.memory_reserved() - reserved)
        return graph, batch, logits

