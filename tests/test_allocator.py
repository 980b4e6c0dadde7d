"""BlockAllocator: unit tests, and a hypothesis state machine checked against a shadow model of the KV contents.

The shadow model gives every appended token a unique id and keeps a fake physical store ``slot -> token id``. After
each append it applies the returned copy-on-write copies to the store first, then writes the new ids at the returned
slots; reading every sequence back through its block table must give exactly its ids. A shared block written in
place, or a missing or wrong copy, shows up as a wrong id in some other sequence.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_paged.allocator import NULL_BLOCK, BlockAllocator
from hf_paged.errors import OutOfBlocksError


def snapshot(a: BlockAllocator):
    """Everything an append that fails must leave untouched."""
    return (
        {s: list(a.block_table(s)) for s in a.sequences},
        {s: a.seq_len(s) for s in a.sequences},
        [a.refcount(b) for b in range(a.capacity)],
        sorted(a._free),
        a.capacity,
        a.num_free,
    )


def blocks(n_tokens: int, block_size: int) -> int:
    return -(-n_tokens // block_size)


# ---------------------------------------------------------------------------------------------------------------------
# Unit tests
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -1, 1.5, True, "16", None])
def test_invalid_block_size(block_size):
    with pytest.raises(ValueError, match=r"block_size must be a positive int, got"):
        BlockAllocator(block_size=block_size)


@pytest.mark.parametrize("num_blocks", [0, -3, 2.0, False, "8"])
def test_invalid_num_blocks(num_blocks):
    with pytest.raises(ValueError, match=r"num_blocks must be a positive int or None .*got"):
        BlockAllocator(block_size=4, num_blocks=num_blocks)


def test_append_exactly_one_block_then_one_more():
    a = BlockAllocator(block_size=4, num_blocks=8)
    s = a.new_sequence()
    plan = a.append([(s, 4)])
    (b0,) = a.block_table(s)
    assert plan.slots == [[b0 * 4 + i for i in range(4)]] and plan.copies == []
    assert a.seq_len(s) == 4 and a.blocks_needed(s, 1) == 1
    plan = a.append([(s, 1)])
    b0_, b1 = a.block_table(s)
    assert b0_ == b0 and b1 != b0 and plan.slots == [[b1 * 4]]
    assert a.blocks_in_use == 2
    a.check_invariants()


def test_append_block_size_plus_one_at_once():
    a = BlockAllocator(block_size=4, num_blocks=8)
    s = a.new_sequence()
    plan = a.append([(s, 5)])
    b0, b1 = a.block_table(s)
    assert plan.slots == [[b0 * 4, b0 * 4 + 1, b0 * 4 + 2, b0 * 4 + 3, b1 * 4]]
    assert a.blocks_needed(s, 3) == 0 and a.blocks_needed(s, 4) == 1 and a.blocks_needed(s, 0) == 0
    a.check_invariants()


def test_append_zero_tokens_takes_nothing():
    a = BlockAllocator(block_size=4, num_blocks=1)
    s = a.new_sequence()
    assert a.append([(s, 0)]).slots == [[]]
    assert a.block_table(s) == [] and a.num_free == 1


def test_batched_append_is_all_or_nothing():
    a = BlockAllocator(block_size=4, num_blocks=3)
    s, t = a.new_sequence(), a.new_sequence()
    a.append([(s, 2)])
    before = snapshot(a)
    with pytest.raises(OutOfBlocksError) as err:
        a.append([(s, 2), (t, 9)])  # s fits in its block, t needs 3 blocks; only 2 are free
    assert snapshot(a) == before
    assert (err.value.needed, err.value.free, err.value.capacity) == (3, 2, 3)
    assert "needed 3 blocks of 4 tokens, 2 of 3 free" in str(err.value)
    a.check_invariants()


def test_fork_shares_every_block():
    a = BlockAllocator(block_size=4, num_blocks=8)
    s = a.new_sequence()
    a.append([(s, 10)])
    child = a.fork(s)
    assert a.block_table(child) == a.block_table(s) and a.block_table(child) is not a.block_table(s)
    assert a.seq_len(child) == 10
    assert all(a.refcount(b) == 2 for b in a.block_table(s))
    assert a.blocks_in_use == 3
    a.check_invariants()


def test_fork_then_append_copies_the_shared_partial_block():
    a = BlockAllocator(block_size=4, num_blocks=8)
    s = a.new_sequence()
    a.append([(s, 6)])
    child = a.fork(s)
    full, partial = a.block_table(s)
    plan = a.append([(child, 1)])
    fresh = a.block_table(child)[1]
    assert plan.copies == [(partial, fresh)] and fresh not in (full, partial)
    assert plan.slots == [[fresh * 4 + 2]]
    assert a.block_table(child)[0] == full and a.refcount(full) == 2
    assert a.refcount(partial) == 1 and a.refcount(fresh) == 1
    plan = a.append([(s, 1)])  # s is now the partial block's only owner: written in place
    assert plan.copies == [] and plan.slots == [[partial * 4 + 2]]
    a.check_invariants()


def test_fork_at_block_boundary_needs_no_copy():
    a = BlockAllocator(block_size=4, num_blocks=8)
    s = a.new_sequence()
    a.append([(s, 8)])
    child = a.fork(s)
    plan = a.append([(s, 1), (child, 1)])
    assert plan.copies == []
    assert a.block_table(s)[:2] == a.block_table(child)[:2]
    assert a.block_table(s)[2] != a.block_table(child)[2]
    a.check_invariants()


def test_crop_releases_emptied_blocks():
    a = BlockAllocator(block_size=4, num_blocks=8)
    s = a.new_sequence()
    a.append([(s, 11)])
    b0, b1, b2 = a.block_table(s)
    a.crop(s, 5)
    assert a.block_table(s) == [b0, b1] and a.seq_len(s) == 5
    assert a.refcount(b2) == 0 and a.num_free == 6
    a.crop(s, 4)
    assert a.block_table(s) == [b0] and a.num_free == 7
    plan = a.append([(s, 1)])  # the next token starts a new block again
    assert len(a.block_table(s)) == 2 and plan.slots[0][0] % 4 == 0
    a.crop(s, 0)
    assert a.block_table(s) == [] and a.num_free == 8
    a.check_invariants()


def test_crop_keeps_shared_blocks_for_the_other_owner():
    a = BlockAllocator(block_size=4, num_blocks=8)
    s = a.new_sequence()
    a.append([(s, 8)])
    child = a.fork(s)
    b0, b1 = a.block_table(s)
    a.crop(child, 3)
    assert a.block_table(s) == [b0, b1] and a.block_table(child) == [b0]
    assert a.refcount(b0) == 2 and a.refcount(b1) == 1 and a.num_free == 6
    a.check_invariants()


@pytest.mark.parametrize("new_len", [-1, 11])
def test_crop_out_of_range_raises(new_len):
    a = BlockAllocator(block_size=4)
    s = a.new_sequence()
    a.append([(s, 10)])
    with pytest.raises(ValueError, match=rf"cannot crop a sequence of 10 tokens to {new_len}"):
        a.crop(s, new_len)


def test_crop_below_slid_out_window_raises():
    a = BlockAllocator(block_size=4, num_blocks=8)
    s = a.new_sequence()
    a.append([(s, 13)])
    b0, b1, b2, b3 = a.block_table(s)
    assert a.release_outside_window(s, 9) == 2  # tokens 0..7 are whole blocks outside the window
    assert a.block_table(s) == [NULL_BLOCK, NULL_BLOCK, b2, b3]
    assert a.refcount(b0) == a.refcount(b1) == 0 and a.num_free == 6
    assert a.release_outside_window(s, 9) == 0  # idempotent
    before = snapshot(a)
    with pytest.raises(ValueError, match=r"slid out of the attention window"):
        a.crop(s, 6)
    assert snapshot(a) == before
    a.crop(s, 0)  # dropping everything is always possible
    assert a.block_table(s) == [] and a.num_free == 8
    a.check_invariants()


def test_release_outside_window_keeps_partial_blocks():
    a = BlockAllocator(block_size=4, num_blocks=8)
    s = a.new_sequence()
    a.append([(s, 10)])
    assert a.release_outside_window(s, 3) == 0  # block 0 still holds token 3
    assert a.release_outside_window(s, 4) == 1
    assert a.release_outside_window(s, 10) == 1  # block 2 (tokens 8, 9) is the tail: kept
    assert a.block_table(s)[:2] == [NULL_BLOCK, NULL_BLOCK] and a.block_table(s)[2] != NULL_BLOCK
    plan = a.append([(s, 3)])
    assert plan.copies == [] and all(slot >= 0 for slot in plan.slots[0])
    a.check_invariants()


def test_release_outside_window_past_the_end_keeps_the_tail():
    a = BlockAllocator(block_size=4)
    s = a.new_sequence()
    a.append([(s, 5)])
    try:
        a.release_outside_window(s, 8)
    except ValueError:
        return  # rejecting keep_from > seq_len is a fine answer too
    plan = a.append([(s, 1)])
    assert all(slot >= 0 for slot in plan.slots[0]), plan
    a.check_invariants()


def test_reorder_beam_style_shares_tables():
    a = BlockAllocator(block_size=4, num_blocks=16)
    seqs = [a.new_sequence() for _ in range(4)]
    a.append([(s, 6 + i) for i, s in enumerate(seqs)])
    old = [list(a.block_table(s)) for s in seqs]
    a.reorder(seqs, [0, 0, 1, 1])
    assert a.block_table(seqs[0]) == a.block_table(seqs[1]) == old[0]
    assert a.block_table(seqs[2]) == a.block_table(seqs[3]) == old[1]
    assert [a.seq_len(s) for s in seqs] == [6, 6, 7, 7]
    assert all(a.refcount(b) == 2 for b in old[0] + old[1])
    assert all(a.refcount(b) == 0 for b in old[2] + old[3])
    a.check_invariants()
    plan = a.append([(s, 1) for s in seqs])  # four beams on two shared partial blocks: two copies
    assert len(plan.copies) == 2
    assert len({slot for slots in plan.slots for slot in slots}) == 4
    a.check_invariants()


def test_reorder_identity_and_permutation():
    a = BlockAllocator(block_size=2)
    seqs = [a.new_sequence() for _ in range(3)]
    a.append([(s, 3 + i) for i, s in enumerate(seqs)])
    old = [list(a.block_table(s)) for s in seqs]
    a.reorder(seqs, [0, 1, 2])
    assert [a.block_table(s) for s in seqs] == old
    a.reorder(seqs, [2, 0, 1])
    assert [a.block_table(s) for s in seqs] == [old[2], old[0], old[1]]
    assert [a.seq_len(s) for s in seqs] == [5, 3, 4]
    a.check_invariants()


@pytest.mark.parametrize("order, match", [([0], r"reorder got 1 indices for 2 sequences"),
                                          ([0, 2], r"reorder indices must lie in \[0, 2\)"),
                                          ([-1, 0], r"reorder indices must lie in \[0, 2\)")])
def test_reorder_bad_order_raises(order, match):
    a = BlockAllocator(block_size=2)
    seqs = [a.new_sequence() for _ in range(2)]
    a.append([(s, 3) for s in seqs])
    before = snapshot(a)
    with pytest.raises(ValueError, match=match):
        a.reorder(seqs, order)
    assert snapshot(a) == before


def test_reorder_across_groups_raises():
    a = BlockAllocator(block_size=2)
    seqs = [a.new_sequence(group=g) for g in (0, 1)]
    a.append([(s, 3) for s in seqs])
    before = snapshot(a)
    with pytest.raises(ValueError, match=r"sequences of different groups"):
        a.reorder(seqs, [1, 0])
    assert snapshot(a) == before


def test_unknown_or_freed_sequence_raises_key_error():
    a = BlockAllocator(block_size=2)
    s = a.new_sequence()
    a.free(s)
    for call in (lambda: a.free(s), lambda: a.append([(s, 1)]), lambda: a.fork(s), lambda: a.crop(s, 0),
                 lambda: a.block_table(s), lambda: a.seq_len(s), lambda: a.release_outside_window(s, 0)):
        with pytest.raises(KeyError, match=rf"sequence {s} is not allocated"):
            call()


def test_unbounded_pool_grows_on_demand():
    a = BlockAllocator(block_size=4)
    assert a.capacity == 0 and a.max_blocks is None
    seqs = [a.new_sequence() for _ in range(5)]
    for step in range(1, 40):
        a.append([(s, 1 + i % 3) for i, s in enumerate(seqs)])
        a.check_invariants()
        used = sum(blocks(a.seq_len(s), 4) for s in seqs)
        assert a.blocks_in_use == used and a.peak_blocks_in_use == used
        assert a.capacity <= max(2 * used, 1)  # grows geometrically, not without bound
    a.reset()
    assert a.blocks_in_use == 0 and a.sequences == [] and a.num_free == a.capacity


def test_set_limit_caps_an_unbounded_pool():
    a = BlockAllocator(block_size=4)
    s = a.new_sequence()
    a.append([(s, 12)])
    with pytest.raises(ValueError, match=r"cannot cap the pool at 2 blocks: 3 already exist"):
        a.set_limit(2)
    a.set_limit(5)
    assert a.num_free == 2
    a.append([(s, 8)])
    with pytest.raises(OutOfBlocksError, match=r"needed 1 block of 4 tokens, 0 of 5 free"):
        a.append([(s, 1)])
    a.check_invariants()


def test_reset_frees_every_block():
    a = BlockAllocator(block_size=3, num_blocks=10)
    s = a.new_sequence()
    a.append([(s, 7)])
    a.fork(s)
    a.reorder([s], [0])
    a.reset()
    assert a.sequences == [] and a.blocks_in_use == 0 and a.num_free == 10
    a.check_invariants()


def test_same_sequence_twice_in_one_append():
    a = BlockAllocator(block_size=4, num_blocks=1)
    s = a.new_sequence()
    a.append([(s, 3)])
    before = snapshot(a)
    try:
        a.append([(s, 1), (s, 1)])  # the second token needs a second block, which does not exist
    except (ValueError, OutOfBlocksError):
        assert snapshot(a) == before
        return
    raise AssertionError("append of 5 tokens into a 1-block pool did not fail")


def test_sharers_appending_together_fit_exactly():
    a = BlockAllocator(block_size=4, num_blocks=2)
    s = a.new_sequence()
    a.append([(s, 3)])
    t = a.fork(s)
    plan = a.append([(s, 1), (t, 1)])  # needs exactly one copy; one block is free
    assert len(plan.copies) == 1


# ---------------------------------------------------------------------------------------------------------------------
# State machine against a shadow model of the KV contents
# ---------------------------------------------------------------------------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Random new_sequence / append / fork / reorder / crop / free / release_outside_window / reset, over sequences of
    two groups (as a cache's layer groups), with blocks in use and their peak checked per group."""

    NUM_BLOCKS: int | None = None
    GROW_INTO_CAP = False  # start empty and grow up to the cap (set_limit), as a BlockPool's allocator does

    @initialize(block_size=st.integers(1, 5))
    def setup(self, block_size):
        if self.GROW_INTO_CAP:
            self.a = BlockAllocator(block_size=block_size)
            self.a.set_limit(self.NUM_BLOCKS)
        else:
            self.a = BlockAllocator(block_size=block_size, num_blocks=self.NUM_BLOCKS)
        self.bs = block_size
        self.peaks: dict[int, int] = {}  # group -> the most blocks its sequences held after an append
        self.tokens: dict[int, list[int]] = {}  # seq -> its token ids, position by position
        self.slid: dict[int, int] = {}  # seq -> leading logical blocks released by release_outside_window
        self.store: dict[int, int] = {}  # physical slot -> token id
        self.next_token = 0

    # ----------------------------------------------------------------- helpers
    def pick(self, data, label="seq"):
        return data.draw(st.sampled_from(sorted(self.tokens)), label=label)

    def true_need(self, requests):
        """Blocks the batch really takes: new tail blocks, plus a copy for a shared partial tail."""
        a, bs = self.a, self.bs
        pending_copies: dict[int, int] = {}
        need = 0
        for seq, n in requests:
            if n == 0:
                continue
            length = a.seq_len(seq)
            need += blocks(length + n, bs) - blocks(length, bs)
            if length % bs:
                last = a.block_table(seq)[-1]
                sharers = a.refcount(last) - pending_copies.get(last, 0)
                if sharers > 1:
                    need += 1
                    pending_copies[last] = pending_copies.get(last, 0) + 1
        return need

    def in_use_by_group(self) -> dict[int, int]:
        held: dict[int, set[int]] = {}
        for seq in self.tokens:
            held.setdefault(self.a.group_of(seq), set()).update(b for b in self.a.block_table(seq) if b != NULL_BLOCK)
        return {g: len(b) for g, b in held.items() if b}

    # ------------------------------------------------------------------- rules
    @rule(group=st.integers(0, 1))
    def new_sequence(self, group):
        seq = self.a.new_sequence(group=group)
        assert seq not in self.tokens and self.a.group_of(seq) == group
        self.tokens[seq], self.slid[seq] = [], 0

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append(self, data):
        a, bs = self.a, self.bs
        live = sorted(self.tokens)
        chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4, unique=True), label="seqs")
        counts = data.draw(st.lists(st.integers(0, 2 * bs + 1), min_size=len(chosen), max_size=len(chosen)),
                           label="counts")
        self.check_append(list(zip(chosen, counts)))

    @precondition(lambda self: self.tokens)
    @rule()
    def decode_step(self):
        """One new token on every live sequence, as in a (beam) decode step."""
        self.check_append([(seq, 1) for seq in sorted(self.tokens)])

    def check_append(self, requests):
        a, bs = self.a, self.bs
        before = snapshot(a)
        claimed = a.blocks_needed_for(requests)
        need = self.true_need(requests)
        assert need == claimed
        free_before = a.num_free
        owned_before = {b for t in before[0].values() for b in t if b != NULL_BLOCK}
        try:
            plan = a.append(requests)
        except OutOfBlocksError as err:
            assert self.NUM_BLOCKS is not None, "an unbounded pool ran out of blocks"
            assert snapshot(a) == before
            assert (err.needed, err.free) == (claimed, free_before) and claimed > free_before
            blocks = "1 block" if claimed == 1 else f"{claimed} blocks"
            assert f"needed {blocks} of {bs} tokens, {free_before} of {self.NUM_BLOCKS} free" in str(err)
            return
        if self.NUM_BLOCKS is not None:
            assert need <= claimed <= free_before
        assert len(plan.slots) == len(requests)

        # copies: from a block that was shared, into one that nobody owned
        for src, dst in plan.copies:
            assert src in owned_before and dst not in owned_before
            assert before[2][src] > 1
        for src, dst in plan.copies:
            for off in range(bs):
                if src * bs + off in self.store:
                    self.store[dst * bs + off] = self.store[src * bs + off]
                else:
                    self.store.pop(dst * bs + off, None)

        written = [slot for slots in plan.slots for slot in slots]
        assert len(set(written)) == len(written), "two tokens got the same slot"
        for (seq, n), slots in zip(requests, plan.slots):
            assert len(slots) == n
            table, length = a.block_table(seq), a.seq_len(seq)
            assert length == len(self.tokens[seq]) + n
            for pos, slot in zip(range(length - n, length), slots):
                block = slot // bs
                assert slot >= 0 and block == table[pos // bs] and slot % bs == pos % bs
                assert a.refcount(block) == 1, f"slot {slot} lies in block {block} shared by {a.refcount(block)}"
                self.store[slot] = self.next_token
                self.tokens[seq].append(self.next_token)
                self.next_token += 1
        used_now = a.capacity - len(a._free)
        assert a.peak_blocks_in_use >= used_now
        for group, count in self.in_use_by_group().items():
            self.peaks[group] = max(self.peaks.get(group, 0), count)
        assert {g: n for g, n in a.peak_by_group.items() if n} == self.peaks

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        seq = self.pick(data)
        child = self.a.fork(seq)
        assert child not in self.tokens and self.a.group_of(child) == self.a.group_of(seq)
        self.tokens[child], self.slid[child] = list(self.tokens[seq]), self.slid[seq]
        assert all(self.a.refcount(b) >= 2 for b in self.a.block_table(child) if b != NULL_BLOCK)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def reorder(self, data):
        group = self.a.group_of(self.pick(data))  # a cache reorders each layer group's sequences on its own
        live = sorted(s for s in self.tokens if self.a.group_of(s) == group)
        seqs = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=5, unique=True), label="seqs")
        seqs = data.draw(st.permutations(seqs), label="seq order")
        order = data.draw(st.lists(st.integers(0, len(seqs) - 1), min_size=len(seqs), max_size=len(seqs)),
                          label="beam_idx")
        old_tables = [list(self.a.block_table(s)) for s in seqs]
        new_tokens = [list(self.tokens[seqs[i]]) for i in order]
        new_slid = [self.slid[seqs[i]] for i in order]
        self.a.reorder(seqs, order)
        for j, seq in enumerate(seqs):
            self.tokens[seq], self.slid[seq] = new_tokens[j], new_slid[j]
            assert self.a.block_table(seq) == old_tables[order[j]]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def crop(self, data):
        seq = self.pick(data)
        length = len(self.tokens[seq])
        new_len = data.draw(st.integers(0, length), label="new_len")
        before = snapshot(self.a)
        keep = blocks(new_len, self.bs)
        if new_len and keep <= self.slid[seq]:  # the kept tail block was released
            with pytest.raises(ValueError, match=r"slid out of the attention window"):
                self.a.crop(seq, new_len)
            assert snapshot(self.a) == before
            return
        dropped = before[0][seq][keep:]
        freed = {b for b in dropped if b != NULL_BLOCK and before[2][b] == dropped.count(b)}
        self.a.crop(seq, new_len)
        del self.tokens[seq][new_len:]
        self.slid[seq] = min(self.slid[seq], keep)
        assert self.a.num_free == before[5] + len(freed)
        assert all(self.a.refcount(b) == 0 for b in freed)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release_outside_window(self, data):
        seq = self.pick(data)
        keep_from = data.draw(st.integers(-1, len(self.tokens[seq])), label="keep_from")  # past the end is clamped
        table = list(self.a.block_table(seq))
        upto = max(0, min(keep_from // self.bs, len(table)))
        expected = sum(1 for b in table[:upto] if b != NULL_BLOCK)
        assert self.a.release_outside_window(seq, keep_from) == expected
        self.slid[seq] = max(self.slid[seq], upto)
        assert self.a.block_table(seq)[:upto] == [NULL_BLOCK] * upto

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = self.pick(data)
        self.a.free(seq)
        del self.tokens[seq], self.slid[seq]

    @rule()
    def reset(self):
        self.a.reset()
        self.tokens.clear()
        self.slid.clear()
        self.all_blocks_free()

    # -------------------------------------------------------------- invariants
    @invariant()
    def bookkeeping_is_consistent(self):
        a = self.a
        a.check_invariants()
        counts = [0] * a.capacity
        for seq in self.tokens:
            for b in a.block_table(seq):
                if b != NULL_BLOCK:
                    counts[b] += 1
        assert counts == [a.refcount(b) for b in range(a.capacity)]
        assert a.blocks_in_use == sum(1 for c in counts if c)
        free = list(a._free)
        assert len(set(free)) == len(free) and all(counts[b] == 0 for b in free)
        if self.NUM_BLOCKS is not None:
            assert a.capacity <= self.NUM_BLOCKS and a.num_free == len(free) + self.NUM_BLOCKS - a.capacity
            assert a.capacity == self.NUM_BLOCKS or self.GROW_INTO_CAP
        assert sorted(a.sequences) == sorted(self.tokens)
        assert {g: n for g, n in a.blocks_in_use_by_group().items() if n} == self.in_use_by_group()

    @invariant()
    def every_sequence_reads_back_its_tokens(self):
        a, bs = self.a, self.bs
        for seq, ids in self.tokens.items():
            table = a.block_table(seq)
            assert a.seq_len(seq) == len(ids) and len(table) == blocks(len(ids), bs)
            for i, b in enumerate(table):
                assert (b == NULL_BLOCK) == (i < self.slid[seq]), (seq, table, self.slid[seq])
            for pos, token in enumerate(ids):
                b = table[pos // bs]
                if b != NULL_BLOCK:
                    assert self.store.get(b * bs + pos % bs) == token, (seq, pos, table)

    def all_blocks_free(self):
        a = self.a
        a.check_invariants()
        assert a.blocks_in_use == 0 and len(a._free) == a.capacity
        assert all(a.refcount(b) == 0 for b in range(a.capacity))

    def teardown(self):
        if not hasattr(self, "a"):
            return
        for seq in list(self.tokens):
            self.a.free(seq)
        self.all_blocks_free()


MACHINE_SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])


class BoundedPool(AllocatorMachine):
    NUM_BLOCKS = 6  # small: OutOfBlocksError happens often


class UnboundedPool(AllocatorMachine):
    NUM_BLOCKS = None


class GrowingBoundedPool(AllocatorMachine):
    NUM_BLOCKS = 6
    GROW_INTO_CAP = True


TestBoundedPool = BoundedPool.TestCase
TestBoundedPool.settings = MACHINE_SETTINGS
TestGrowingBoundedPool = GrowingBoundedPool.TestCase
TestGrowingBoundedPool.settings = settings(MACHINE_SETTINGS, max_examples=50)
TestUnboundedPool = UnboundedPool.TestCase
TestUnboundedPool.settings = MACHINE_SETTINGS


def test_set_limit_at_the_current_capacity_is_allowed_below_it_refused():
    a = BlockAllocator(block_size=4)
    seq = a.new_sequence()
    a.append([(seq, 9)])  # 3 blocks exist
    a.set_limit(a.capacity)  # a cap equal to what exists is fine
    assert a.max_blocks == a.capacity and a.num_free == a.capacity - a.blocks_in_use
    with pytest.raises(ValueError, match="already exist"):
        a.set_limit(a.capacity - 1)


def test_blocks_in_use_and_peaks_are_counted_per_group():
    """A sliding group that gives blocks back peaks lower than a full group growing beside it; the total peak is
    the most blocks held at once over both."""
    a = BlockAllocator(block_size=4)
    full, sliding = a.new_sequence(group=0), a.new_sequence(group=1)
    for _ in range(5):
        a.append([(full, 4), (sliding, 4)])
        a.release_outside_window(sliding, a.seq_len(sliding) - 4)  # keep the last block only
    assert a.blocks_in_use_by_group() == {0: 5, 1: 1}
    assert a.peak_by_group == {0: 5, 1: 2} and a.peak_blocks_in_use == 7
    child = a.fork(sliding)
    assert a.group_of(child) == 1 and a.blocks_in_use_by_group() == {0: 5, 1: 1}  # shared, not new
    a.free(full)
    assert a.blocks_in_use_by_group() == {0: 0, 1: 1} and a.peak_by_group == {0: 5, 1: 2}
    a.check_invariants()


def test_cached_block_taken_back_counts_for_its_new_holder_group():
    a = BlockAllocator(block_size=2, prefix_caching=True)
    seq = a.new_sequence(group=0)
    a.append([(seq, 4)], [[5, 6, 7, 8]])
    a.free(seq)
    assert a.num_cached == 2 and a.blocks_in_use_by_group() == {0: 0}
    again = a.new_sequence(a.match_prefix([5, 6, 7, 8, 9]), group=3)
    assert a.blocks_in_use_by_group() == {0: 0, 3: 2}
    a.check_invariants()
    a.free(again)
    assert a.blocks_in_use_by_group() == {0: 0, 3: 0}


def test_capped_allocator_grows_into_its_cap_before_evicting_cached_blocks():
    """A capped pool keeps prefix-cached blocks until the cap is reached; an uncapped one evicts before growing."""
    evictions = {}
    for cap in (8, None):
        a = BlockAllocator(block_size=2, prefix_caching=True)
        if cap is not None:
            a.set_limit(cap)
        first = a.new_sequence()
        a.append([(first, 4)], [[5, 6, 7, 8]])
        a.free(first)
        second = a.new_sequence()
        a.append([(second, 4)], [[9, 10, 11, 12]])
        evictions[cap] = a.evictions
        a.check_invariants()
        if cap is not None:
            assert a.capacity == 4 and a.num_cached == 2 and a.match_prefix([5, 6, 7, 8]) != []
            third = a.new_sequence()
            a.append([(third, 10)], [list(range(20, 30))])  # 5 blocks: 4 more fit under the cap, then 1 eviction
            assert a.capacity == 8 and a.evictions == 1
    assert evictions == {8: 0, None: 2}
