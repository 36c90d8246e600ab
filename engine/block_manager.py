"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, prefix caching.

A block is reusable by any request whose tokens up to and including that block
match: its key is a hash chained over all earlier blocks' tokens. Freed blocks
keep their hash (and content) until they are handed out again, so a later
request with the same prefix finds them in the free list (LRU eviction).
"""
from collections import OrderedDict

from tandem.engine.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evict first
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def _hashes(self, req: Request, num_blocks: int) -> list[int]:
        """Chained hashes of req's first num_blocks full blocks (memoized on the request: the
        tokens of a full block never change)."""
        hashes, bs = req.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash((hashes[-1] if hashes else None, tuple(req.all_token_ids[i * bs:(i + 1) * bs]))))
        return hashes[:num_blocks]

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Block ids holding the longest cached prefix of req; at least one token is left to
        compute (its logits give the next token). Empty when prefix caching is off."""
        if not self.enable_prefix_caching or req.wants_prompt_logprobs:
            return []
        hit = []
        for h in self._hashes(req, (req.num_tokens - 1) // self.block_size):
            block = self.cached.get(h)
            if block is None:
                break
            hit.append(block)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hit) * self.block_size
        return hit

    def num_blocks_needed(self, req: Request, num_new_tokens: int, cached: list[int] = ()) -> int:
        """Free-list blocks that allocate() would consume."""
        have = len(req.block_ids) + len(cached)
        new = max(0, _cdiv(req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens,
                           self.block_size) - have)
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)
        return new + revived

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Give req blocks for num_new_tokens more tokens (after any cached prefix blocks, which
        are appended first and count as computed). False, changing nothing, if too few are free."""
        if self.num_blocks_needed(req, num_new_tokens, cached) > len(self.free_queue):
            return False
        for b in cached:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1
        req.block_ids.extend(cached)
        req.num_computed_tokens += len(cached) * self.block_size
        target = _cdiv(req.num_computed_tokens + num_new_tokens, self.block_size)
        while len(req.block_ids) < target:
            b, _ = self.free_queue.popitem(last=False)
            self._evict(b)
            self.ref_counts[b] = 1
            req.block_ids.append(b)
        return True

    def _evict(self, block: int) -> None:
        h = self.block_hashes[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hashes[block] = None

    def cache_full_blocks(self, req: Request) -> None:
        """Publish the hashes of req's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        hashes = self._hashes(req, num_full)
        for block, h in zip(req.block_ids[:num_full], hashes):
            if self.block_hashes[block] is None and h not in self.cached:
                self.block_hashes[block] = h
                self.cached[h] = block

    def free_blocks(self, block_ids: list[int]) -> None:
        # Tail blocks first, so they are evicted before the shared prefix blocks.
        for b in reversed(block_ids):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} freed twice"
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None

