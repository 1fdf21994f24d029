"""Prefix caching (vLLM's automatic prefix caching): a full block is named by a digest chained over the token ids of
the whole prefix up to its end, so two sequences with the same first k blocks of tokens name the same k blocks and can
share them. A block no sequence holds any more stays in the cache, to be found again, until the pool needs it: then
the least recently released goes first (LRU)."""
import hashlib
from array import array
from collections import OrderedDict


def extend_digests(digests: list[bytes], token_ids: list[int], block_size: int) -> list[bytes]:
    """Grow `digests` (one per full block, in order) to cover every full block of token_ids; returns it. SHA-256
    over the parent's digest and the block's ids: a collision would silently hand one prompt another's keys."""
    for i in range(len(digests), len(token_ids) // block_size):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        digests.append(hashlib.sha256((digests[-1] if digests else b"") + block).digest())
    return digests


class PrefixCache:
    """Which pool block holds each cached prefix digest, and the cached blocks no sequence holds (evictable)."""

    def __init__(self):
        self.blocks: dict[bytes, int] = {}  # digest -> block
        self.digests: dict[int, bytes] = {}  # block -> digest
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unheld cached blocks, least recently released first

    def lookup(self, digest: bytes) -> int | None:
        return self.blocks.get(digest)

    def register(self, digest: bytes, block: int) -> None:
        """Name a block just filled; the first block filled with a prefix keeps the name (a twin stays private)."""
        if digest not in self.blocks and block not in self.digests:
            self.blocks[digest], self.digests[block] = block, digest

    def holds(self, block: int) -> bool:
        return block in self.digests

    def park(self, block: int) -> None:
        """The last holder let go: keep the contents, first in line to be evicted after older ones."""
        self.evictable[block] = None

    def unpark(self, block: int) -> None:
        del self.evictable[block]

    def evict(self) -> int:
        """Forget the least recently released cached block and hand it over for reuse."""
        block, _ = self.evictable.popitem(last=False)
        del self.blocks[self.digests.pop(block)]
        return block
