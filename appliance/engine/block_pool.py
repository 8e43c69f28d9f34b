"""The fixed pool of KV-cache block ids, with reference counts (pure Python, no torch).

Every block is in exactly one of three places, which is what `check_accounting` verifies:

- free:   refcount 0, holds nothing reusable; allocated first.
- cached: refcount 0, holds a full block registered in the prefix cache; reusable by a later prefix hit,
          evicted least-recently-used first when the free list runs dry.
- owned:  refcount > 0, in the block table of at least one live request (shared prefix blocks have
          refcount > 1; they may also be registered in the prefix cache).

A sliding-window group's pool (kv_groups.py) reserves block 0 as its null block (`null_block=True`): the table
entry of a block released out of the window. It is in none of the three places, never allocated, and counted in
no total; any reference to it is a bug.

The pool does not know hashes: the prefix cache marks blocks as cached and is told (through `on_evict`) when
the pool reclaims one, so it can forget the hash and publish a removal.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass


class BlockPoolError(RuntimeError):
    """Misuse of the pool (double free, incref of a free block, ...): always a bug in the caller."""


class NoFreeBlocks(RuntimeError):
    """An allocation asked for more blocks than are free or evictable; nothing was allocated."""


@dataclass(frozen=True)
class AccountingReport:
    total: int
    free: int
    cached: int  # unreferenced, reusable prefix-cache blocks
    owned: int  # referenced by at least one request
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems and self.free + self.cached + self.owned == self.total


class BlockPool:
    def __init__(self, num_blocks: int, null_block: bool = False) -> None:
        if num_blocks < 1 + null_block:
            raise ValueError(f"num_blocks must be >= {1 + null_block}, got {num_blocks}")
        self.num_blocks = num_blocks  # ids 0 .. num_blocks - 1, the null block included
        self.null_block = null_block
        self._first = int(null_block)  # the first id that is ever allocated
        self._ref = [0] * num_blocks
        self._is_cached = [False] * num_blocks  # registered in the prefix cache
        self._free: deque[int] = deque(range(self._first, num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached and unreferenced, LRU first
        self.on_evict: Callable[[int], None] | None = None

    # ---- queries -----------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_usable(self) -> int:
        """Blocks that can hold KV: all but the null block."""
        return self.num_blocks - self._first

    @property
    def num_owned(self) -> int:
        return self.num_usable - self.num_available

    def refcount(self, block_id: int) -> int:
        return self._ref[self._check_id(block_id)]

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def usage(self) -> float:
        """Fraction of blocks held by live requests (evictable cache blocks count as available)."""
        return self.num_owned / self.num_usable

    # ---- mutations ---------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take n blocks (refcount 1 each), evicting LRU cached blocks when the free list is short.

        All or nothing: raises NoFreeBlocks without changing anything when n blocks are not available.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_available:
            raise NoFreeBlocks(f"need {n} blocks, {self.num_available} available")
        out: list[int] = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._uncache(b)
            self._ref[b] = 1
            out.append(b)
        # ascending: the blocks one request takes at once then tend to be a consecutive range (a range is freed
        # and evicted together), so the host tier's copies of them are a few range copies (host_tier.py)
        out.sort()
        return out

    def incref(self, block_id: int) -> None:
        """Take one more reference on a block that is owned, or cached (which revives it from the LRU)."""
        b = self._check_id(block_id)
        if self._ref[b] == 0:
            if b not in self._evictable:
                raise BlockPoolError(f"incref of free block {b}")
            del self._evictable[b]
        self._ref[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id, in the given order (it becomes the LRU order of cached blocks).

        A block reaching refcount 0 goes to the cached LRU if the prefix cache holds it, else to the free
        list. Freeing a block that is not owned raises (double free); earlier ids in the call stay freed.
        """
        for block_id in block_ids:
            b = self._check_id(block_id)
            if self._ref[b] <= 0:
                raise BlockPoolError(f"double free of block {b}")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._is_cached[b]:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def mark_cached(self, block_id: int) -> None:
        """Called by the prefix cache when it registers an owned block's contents."""
        b = self._check_id(block_id)
        if self._ref[b] == 0:
            raise BlockPoolError(f"cannot cache unowned block {b}")
        if self._is_cached[b]:
            raise BlockPoolError(f"block {b} is already cached")
        self._is_cached[b] = True

    def is_cached(self, block_id: int) -> bool:
        return self._is_cached[self._check_id(block_id)]

    def evict_all_cached(self) -> int:
        """Drop every unreferenced cached block to the free list (prefix-cache reset); returns how many."""
        n = 0
        while self._evictable:
            b, _ = self._evictable.popitem(last=False)
            self._uncache(b)
            self._free.append(b)
            n += 1
        return n

    def uncache_owned(self, block_id: int) -> None:
        """Forget that an owned block is cached (reset while requests still hold it); it is freed normally."""
        b = self._check_id(block_id)
        if self._ref[b] == 0 or not self._is_cached[b]:
            raise BlockPoolError(f"block {b} is not an owned cached block")
        self._is_cached[b] = False

    def _uncache(self, b: int) -> None:
        self._is_cached[b] = False
        if self.on_evict is not None:
            self.on_evict(b)

    def _check_id(self, block_id: int) -> int:
        if not self._first <= block_id < self.num_blocks:
            what = "the null block" if self.null_block and block_id == 0 else "out of range"
            raise BlockPoolError(f"block id {block_id} is {what}: ids are [{self._first}, {self.num_blocks})")
        return block_id

    # ---- invariant ---------------------------------------------------------------------------------------
    def check_accounting(self, expected_refs: dict[int, int] | None = None) -> AccountingReport:
        """Count free / cached / owned and look for blocks in two places at once.

        `expected_refs` (block id -> number of live request tables holding it), when given, must equal the
        refcounts: that catches leaks (owned by nobody) and double ownership.
        """
        problems: list[str] = []
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            problems.append("a block appears twice in the free list")
        evict_set = set(self._evictable)
        if free_set & evict_set:
            problems.append(f"blocks both free and cached: {sorted(free_set & evict_set)[:8]}")
        if self.null_block and (self._ref[0] or self._is_cached[0] or 0 in free_set or 0 in evict_set):
            problems.append("the null block is referenced, cached, free or evictable")
        for b in range(self._first, self.num_blocks):
            r = self._ref[b]
            if r < 0:
                problems.append(f"block {b} has refcount {r}")
            in_lists = (b in free_set) + (b in evict_set)
            if r > 0 and in_lists:
                problems.append(f"owned block {b} (ref {r}) is also free or evictable")
            if r == 0 and in_lists != 1:
                problems.append(f"unreferenced block {b} is in {in_lists} lists")
            if b in free_set and self._is_cached[b]:
                problems.append(f"free block {b} still marked cached")
            if b in evict_set and not self._is_cached[b]:
                problems.append(f"evictable block {b} is not marked cached")
        if expected_refs is not None:
            for b in range(self._first, self.num_blocks):
                want = expected_refs.get(b, 0)
                if self._ref[b] != want:
                    problems.append(f"block {b}: refcount {self._ref[b]}, but {want} live tables hold it")
        owned = sum(1 for r in self._ref if r > 0)
        return AccountingReport(
            total=self.num_usable,
            free=len(self._free),
            cached=len(self._evictable),
            owned=owned,
            problems=tuple(problems),
        )
