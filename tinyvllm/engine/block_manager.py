"""The KV cache's block pool: which blocks each sequence owns, and the prefix cache.

A full block is identified by a hash of its tokens chained with the previous block's hash, so equal
hashes mean equal prefixes; the tokens are compared too, so a hash collision cannot give wrong output.
Blocks are reference counted; a block whose count drops to zero keeps its contents and hash and
waits in the free queue, least recently used first, until a new block is needed.

A sequence that starts computing prompt blocks nobody has cached claims them until they are cached (which the
scheduler does once the step computing them is launched): a request that arrives with the same prefix meanwhile
can wait for them (Scheduler) instead of computing them again.

Where every layer of the model attends within a sliding window (CausalLM.sliding_window: Mistral), a sequence's
leading blocks that no query of its can see any more are given back as it advances (remove_skipped_blocks), so that
it holds about window / block_size blocks however long it grows. Its block table keeps their entries, unowned: the
attention ops never read a key before a query's window."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from tinyvllm.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: list[int] = []  # (a list: a sequence's slice compares with it without a conversion)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # the model's, bounding every layer; None: some layer sees it all
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # hash -> block id
        self.claimed: dict[int, int] = {}  # hash of a block being computed -> how many sequences compute it
        self.prefix_cache_queries = 0  # prompt tokens looked up in the cache
        self.prefix_cache_hits = 0  # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def blocks_out_of_window(self, num_computed_tokens: int) -> int:
        """How many leading blocks of a sequence with num_computed_tokens in the cache no query of its will see: its
        queries from now on sit at positions p >= num_computed_tokens, and one sees key j iff p - j < window, so
        keys from num_computed_tokens - window + 1 on. Block b's last key is (b + 1) * block_size - 1; a token
        short of the exact bound, for safety: blocks with (b + 1) * block_size <= num_computed_tokens - window."""
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed_tokens - self.sliding_window) // self.block_size)

    def most_tokens_held(self, chunk: int) -> int | None:
        """Where every layer has the window: the most tokens' worth of blocks one sequence holds at once, however
        long it grows, when a step adds at most `chunk` tokens to it (what blocks_out_of_window gives back leaves the
        window, the chunk and a partial block at each end). None without a window: a sequence holds all it has."""
        if self.sliding_window is None:
            return None
        return self.sliding_window + chunk + 2 * self.block_size

    def remove_skipped_blocks(self, seq: Sequence) -> None:
        """Give back seq's leading blocks that fell out of the window (vLLM's name): as free's, their references
        are dropped (a cached block stays in the prefix cache for others until evicted). The scheduler asks before
        it schedules seq, when no query to come sits before num_computed_tokens (speculation's rejected slots are
        rolled back by then; tokens in flight are real); a block given back now is written by someone else only in
        a later step, which the device runs after the steps in flight that may still read it. With prefix caching
        only registered blocks go: cache_computed_blocks reads the table's entries from num_registered_blocks on
        (the others go once they are registered)."""
        end = self.blocks_out_of_window(seq.num_computed_tokens)
        if self.enable_prefix_caching:
            end = min(end, seq.num_registered_blocks)
        if end <= seq.num_skipped_blocks:
            return
        for block_id in seq.block_table[seq.num_skipped_blocks:end]:
            self._drop(block_id)
        seq.num_skipped_blocks = end

    def _drop(self, block_id: int) -> None:
        """Drop a reference; an unreferenced block joins the free queue (keeping its contents and hash)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached run of seq's full blocks. At least the last token is
        left to compute, so that the step has logits to sample from."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        block_size, blocks, token_ids = self.block_size, self.blocks, seq.token_ids
        max_blocks = (seq.num_tokens - 1) // block_size
        self._hash_full_blocks(seq, max_blocks)
        start = 0
        for block_id in map(self.cached_blocks.get, seq.block_hashes[:max_blocks]):
            if block_id is None or blocks[block_id].token_ids != token_ids[start:start + block_size]:
                break  # (not cached; or a hash collision: not our prefix)
            found.append(block_id)
            start += block_size
        return found

    def is_being_computed(self, seq: Sequence) -> bool:
        """Whether the full block after seq's cached prefix is one that a running sequence has claimed (it will be
        in the cache once that sequence's step has computed it). Cheap enough to ask of every waiting request each
        step: hashes only (a collision costs a needless wait, never a wrong block), from where the last look
        stopped."""
        if not self.claimed:
            return False
        last = (seq.num_tokens - 1) // self.block_size
        i = seq.num_blocks_seen_cached
        if i < last:
            # (the next block's hash first: while a shared prefix is being computed, nothing more is needed yet)
            self._hash_full_blocks(seq, i + 1)
            if seq.block_hashes[i] in self.cached_blocks:
                self._hash_full_blocks(seq, last)
                while i < last and seq.block_hashes[i] in self.cached_blocks:
                    i += 1
        seq.num_blocks_seen_cached = i
        return i < last and seq.block_hashes[i] in self.claimed

    def claim(self, seq: Sequence, first: int) -> None:
        """seq, just given its blocks, computes its full prompt blocks from `first` on (those after its cached
        prefix): claim them until they are cached (cache_computed_blocks) or seq lets go of its blocks (free)."""
        if not self.enable_prefix_caching:
            return
        last = (seq.num_tokens - 1) // self.block_size  # (find_cached_prefix's limit: it hashed these)
        self._hash_full_blocks(seq, last)
        for i in range(first, last):
            h = seq.block_hashes[i]
            self.claimed[h] = self.claimed.get(h, 0) + 1
        seq.claimed_blocks = (first, max(first, last))

    def _release(self, seq: Sequence, upto: int) -> None:
        """Drop seq's claims on its blocks before `upto`."""
        first, last = seq.claimed_blocks
        end = min(upto, last)
        for i in range(first, end):
            h = seq.block_hashes[i]
            if self.claimed[h] == 1:
                del self.claimed[h]
            else:
                self.claimed[h] -= 1
        seq.claimed_blocks = (max(first, end), last)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Give seq enough blocks for num_new_tokens more tokens, taking `cached` prefix blocks first (for a
        sequence without blocks, as find_cached_prefix found them). Returns False, changing nothing, if the pool
        cannot provide them."""
        cached = cached or []
        num_cached_tokens = len(cached) * self.block_size
        total = max(seq.num_computed_tokens, num_cached_tokens) + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(seq.block_table) - len(cached)
        # (a cached prefix longer than the window: its blocks before the window enter the table unowned, as
        # remove_skipped_blocks would leave them, so that taking a long prefix never revives them)
        skipped = self.blocks_out_of_window(num_cached_tokens)
        reviving = sum(1 for b in cached[skipped:] if self.blocks[b].ref_count == 0)
        if num_new_blocks + reviving > self.num_free_blocks:
            return False
        for block_id in cached[skipped:]:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        if cached:  # (seq's first blocks, in the cache already: cache_computed_blocks need not look at them)
            seq.block_table.extend(cached)
            seq.num_registered_blocks = len(cached)
            seq.num_skipped_blocks = skipped
        for _ in range(max(num_new_blocks, 0)):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None and self.cached_blocks.get(block.hash) == block_id:
                del self.cached_blocks[block.hash]  # evict
            block.hash, block.token_ids, block.ref_count = None, [], 1
            seq.block_table.append(block_id)
        return True

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    def free(self, seq: Sequence) -> None:
        """Drop seq's references (those it still holds: not its blocks given back to the window). Its last blocks
        enter the free queue first, so they are evicted before the (more widely shared) blocks of the start of the
        prompt."""
        for block_id in reversed(seq.block_table[seq.num_skipped_blocks:]):
            self._drop(block_id)
        self._release(seq, seq.claimed_blocks[1])
        seq.block_table = []
        seq.num_registered_blocks = seq.num_skipped_blocks = 0

    def free_beyond(self, seq: Sequence, num_tokens: int) -> bool:
        """Give back seq's blocks past those its first num_tokens tokens need (the slots of rejected proposals);
        whether it had any. They hold no full block of real tokens, so no hash: they go to the front of the free
        queue, to be taken first."""
        keep = self.blocks_needed(num_tokens)
        if len(seq.block_table) <= keep:
            return False
        for block_id in seq.block_table[keep:]:
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash is None, "a block past the computed tokens is seq's own"
            self.free_queue[block_id] = None
            self.free_queue.move_to_end(block_id, last=False)
        del seq.block_table[keep:]
        return True

    def cache_full_blocks(self, seqs: Iterable[Sequence | None]) -> None:
        """cache_computed_blocks for each of a step's sequences (None: one gone since) that has a block newly
        full of computed tokens. (The test is written out here, not left to the call: this runs for every
        sequence at every step, and most have no block newly full.)"""
        if not self.enable_prefix_caching:
            return
        block_size = self.block_size
        for seq in seqs:
            if seq is not None and seq.block_table and \
                    min(seq.num_computed_tokens, len(seq.token_ids)) >= (seq.num_registered_blocks + 1) * block_size:
                self.cache_computed_blocks(seq)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register seq's blocks that have become full of computed tokens in the prefix cache (only those
        that filled up since the last call: this runs for every sequence at every step)."""
        if not self.enable_prefix_caching:
            return
        # (Computed tokens are real by now, but a token in flight can be computed before it is read back.)
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        num_full = min(num_full, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        self._hash_full_blocks(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            block.hash = seq.block_hashes[i]
            block.token_ids = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            self.cached_blocks.setdefault(block.hash, block.block_id)
        seq.num_registered_blocks = num_full
        if seq.claimed_blocks[0] < num_full:
            self._release(seq, num_full)

    def _hash_full_blocks(self, seq: Sequence, num_blocks: int) -> None:
        """Extend seq.block_hashes to its first num_blocks blocks: block i's hash is hash((block i-1's hash, block
        i's tokens as a tuple)), so equal hashes mean equal prefixes. (A prompt's ~70 blocks at once, in one loop
        over tuples cut from one slice.)"""
        hashes, block_size = seq.block_hashes, self.block_size
        first = len(hashes)
        if first >= num_blocks:
            return
        prev = hashes[-1] if hashes else None
        tokens = iter(seq.token_ids[first * block_size:num_blocks * block_size])
        for block in zip(*[tokens] * block_size):  # (each block's tokens as a tuple)
            prev = hash((prev, block))
            hashes.append(prev)

    def check_whole(self) -> None:
        """Our invariant once nothing runs: every block is free (possibly cached) and unreferenced."""
        leaked = [b.block_id for b in self.blocks if b.ref_count != 0]
        assert not leaked and self.num_free_blocks == self.num_blocks, f"leaked blocks: {leaked[:10]}"
