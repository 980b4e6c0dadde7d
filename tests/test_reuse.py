"""Reusing KV across calls: copies of a cache and automatic prefix caching (a prompt cache on disk: test_persist.py).

Token equality is always against the same recipe run with ``DynamicCache``. Prefix hits are measured by the tokens
that reach the decoder (a forward pre-hook), not by a flag.
"""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from transformers import DynamicCache

from helpers import (
    VOCAB, chat_inputs, decoder_token_counter, dynamic, forward, generate, left_padded, ones_mask, require_smollm,
    smollm, tiny_config, tiny_model,
)
from hf_paged import BlockAllocator, BlockPool, PagedCache, compat, disable_paged_attention, enable_paged_attention
from hf_paged.allocator import NULL_BLOCK, block_key
from hf_paged.errors import OutOfBlocksError

SYSTEM = (
    "You are Quill, the writing assistant of a small public library. Follow these house rules in every answer. "
    "First, be brief: two or three sentences unless the reader asks for more. Second, be kind and plain: avoid "
    "jargon, explain any technical word you must use, and never talk down to anyone. Third, when a question is "
    "about a book, name the author and the year of first publication if you know them, and say so honestly if "
    "you do not. Fourth, recommend at most three titles at a time, each with one sentence on why it fits. Fifth, "
    "the library opens at nine in the morning and closes at six in the evening from Monday to Friday, and at one "
    "in the afternoon on Saturday; it is closed on Sunday and on public holidays. Sixth, members may borrow up "
    "to eight items for three weeks and renew them twice online, by phone or at the desk, unless someone else "
    "has reserved them. Seventh, the reading room on the second floor is silent; group study rooms on the first "
    "floor can be booked for two hours at a time. Eighth, printing costs ten cents a page in black and white and "
    "fifty cents in colour, and the scanner is free. Ninth, children under twelve need a parent or guardian to "
    "sign their membership form. Tenth, if you are unsure of an answer, suggest that the reader ask a librarian "
    "at the front desk, who will be glad to help. Finally, end every answer with a short, friendly closing line."
)  # ~310 tokens under SmolLM2's chat template
QUESTIONS = ["When does the library open on Saturday?", "How many books can I borrow?",
             "Recommend a novel about the sea."]
NEW_TOKENS = 5

# ---------------------------------------------------------------------------------------------------------------------
# copy.deepcopy / copy.copy / pickle
# ---------------------------------------------------------------------------------------------------------------------


def test_deepcopy_prompt_reuse_recipe_on_smollm():
    """transformers' documented recipe, verbatim: prefill ``tok(prefix)`` once, then ``generate()`` on
    ``tok(prefix + question)`` with a deepcopy of the cache. SmolLM2 tokenizes the prefix's trailing space into
    another token once a question follows it, so the cache's last token differs from input_ids': generate()
    continues from the cached K/V as DynamicCache does (same tokens) and warns at the user's line that this is a
    tokenization boundary."""
    require_smollm()
    model, tokenizer = smollm()
    prefix = "You are a helpful assistant. "
    questions = ["Help me to write a blogpost about travelling.", "What is the capital of France?"]
    prefix_ids = tokenizer(prefix, return_tensors="pt").input_ids
    joined = tokenizer(prefix + questions[0], return_tensors="pt").input_ids
    assert joined[0, prefix_ids.shape[1] - 1] != prefix_ids[0, -1], "the recipe's boundary no longer splits"

    def from_copies(prompt_cache, question_indices):
        return [model.generate(**tokenizer(prefix + questions[i], return_tensors="pt"),
                               **{compat.GENERATE_CACHE_KWARG: copy.deepcopy(prompt_cache)}, max_new_tokens=6,
                               do_sample=False)
                for i in question_indices]

    disable_paged_attention(model)
    prompt_cache = DynamicCache(config=model.config)
    forward(model, prefix_ids, prompt_cache)
    expected = from_copies(prompt_cache, [0, 1])
    enable_paged_attention(model, backend="torch")
    try:
        prompt_cache = PagedCache(model.config)
        forward(model, prefix_ids, prompt_cache)
        tables, lens = prompt_cache.block_tables(), prompt_cache.seq_lens()
        with pytest.warns(UserWarning, match=f"column {prefix_ids.shape[1] - 1} on.*tokenization boundary") as seen:
            got = from_copies(prompt_cache, [0, 1])
        assert all(w.filename == __file__ for w in seen if "tokenization boundary" in str(w.message))
        for g, e in zip(got, expected):
            assert torch.equal(g, e)
        assert prompt_cache.block_tables() == tables and prompt_cache.seq_lens() == lens, "the original changed"
        with pytest.warns(UserWarning, match="tokenization boundary"):  # once per cache: each copy is a new one
            again = from_copies(prompt_cache, [0])[0]
        assert torch.equal(again, expected[0]), "the original's KV was overwritten through a copy"
    finally:
        disable_paged_attention(model)


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_copies_are_independent_and_copy_on_write(copier):
    model = tiny_model("llama")
    prefix = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))  # 2.5 blocks of 4
    tails = [torch.tensor([[5, 6, 7]]), torch.tensor([[40, 41]])]
    ref = dynamic(model)
    forward(model, prefix, ref)
    expected = [generate(model, ones_mask(torch.cat([prefix, t], 1)), copy.deepcopy(ref), max_new_tokens=5)
                for t in tails]
    enable_paged_attention(model, backend="torch")
    pc = PagedCache(model.config, block_size=4)
    forward(model, prefix, pc)
    tables, lens = pc.block_tables(), pc.seq_lens()
    copies = [copier(pc) for _ in tails]
    assert all(c.block_tables() == tables for c in copies), "a copy should share the blocks, not copy them"
    for c, t, e in zip(copies, tails, expected):
        assert torch.equal(generate(model, ones_mask(torch.cat([prefix, t], 1)), c, max_new_tokens=5), e)
    assert pc.block_tables() == tables and pc.seq_lens() == lens
    a, b = (c.block_tables()[0] for c in copies)
    assert a[:2] == b[:2] == tables[0][:2], "full prefix blocks stay shared"
    assert len({a[2], b[2], tables[0][2]}) == 3, "the partly filled block is copied before each copy writes to it"
    pc.pool.allocator.check_invariants()


def test_pickling_is_refused_with_a_pointer_to_save():
    model = tiny_model("llama")
    enable_paged_attention(model, backend="torch")
    pc = PagedCache(model.config)
    forward(model, torch.tensor([[5, 6, 7]]), pc)
    with pytest.raises(TypeError, match=r"cache\.save"):
        pickle.dumps(pc)


# ---------------------------------------------------------------------------------------------------------------------
# Prefix caching end to end
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def system_prompt_runs():
    """SmolLM2: per question, its chat inputs (long shared system prompt) and DynamicCache's greedy tokens."""
    require_smollm()
    model, tokenizer = smollm()
    disable_paged_attention(model)
    runs = []
    for q in QUESTIONS:
        inputs = chat_inputs(tokenizer, [q], system=SYSTEM)
        expected = model.generate(**inputs, **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)},
                                  max_new_tokens=NEW_TOKENS, do_sample=False)
        runs.append((inputs, expected))
    return model, runs


def expected_hit(ids: torch.Tensor, cached: torch.Tensor, block_size: int = 16) -> int:
    """Prompt tokens a cached prompt ``cached`` can give ``ids`` (both ``[1, L]``): whole common blocks, never the
    last prompt token."""
    n = 0
    limit = min(ids.shape[1] - 1, cached.shape[1])
    while n < limit and ids[0, n] == cached[0, n]:
        n += 1
    return n // block_size * block_size


def test_prefix_caching_second_call_prefills_only_new_tokens(system_prompt_runs):
    model, runs = system_prompt_runs
    (first, expected_first), (second, expected_second) = runs[:2]
    enable_paged_attention(model, backend="torch")
    try:
        pool = BlockPool(block_size=16, num_blocks=64, prefix_caching=True)  # room: no cached block is evicted
        with decoder_token_counter(model) as seen:
            out = model.generate(**first, cache=PagedCache(model.config, pool=pool), max_new_tokens=NEW_TOKENS,
                                 do_sample=False)
        assert torch.equal(out, expected_first)
        assert seen[0] == first["input_ids"].shape[1]
        hit = expected_hit(second["input_ids"], first["input_ids"])
        assert hit >= 256, "the questions should share most of the system prompt"
        before = pool.memory_stats()
        cache = PagedCache(model.config, pool=pool)
        with decoder_token_counter(model) as seen:
            out = model.generate(**second, cache=cache, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(out, expected_second)
        print(f"second call: {seen[0]} of {second['input_ids'].shape[1]} prompt tokens computed")
        assert seen[0] == second["input_ids"].shape[1] - hit
        stats = cache.memory_stats()
        assert stats.prefix_hit_tokens - before.prefix_hit_tokens == hit
        assert stats.prefix_query_tokens - before.prefix_query_tokens >= hit
        assert before.blocks_cached >= hit // 16, "the first call's prompt blocks stay cached after it ends"
        del cache
        assert pool.memory_stats().blocks_in_use == 0
        pool.allocator.check_invariants()
    finally:
        disable_paged_attention(model)


def test_prefix_caching_threads_sharing_one_pool(system_prompt_runs):
    model, runs = system_prompt_runs
    enable_paged_attention(model, backend="torch")
    try:
        # Room for every request: a pool evicts cached blocks (least recently used first) before it grows, so on an
        # unbounded pool one thread's new blocks may evict the end of the prompt another thread is about to match.
        pool = BlockPool(block_size=16, num_blocks=64, prefix_caching=True)
        warm_inputs, warm_expected = runs[0]
        assert torch.equal(model.generate(**warm_inputs, cache=PagedCache(model.config, pool=pool),
                                          max_new_tokens=NEW_TOKENS, do_sample=False), warm_expected)
        results, first_forward, errors = {}, {}, []
        lock = threading.Lock()

        def hook(module, args, kwargs):
            with lock:
                first_forward.setdefault(threading.get_ident(), kwargs["input_ids"].shape[1])

        def serve(i):
            try:
                inputs, _ = runs[i]
                out = model.generate(**inputs, cache=PagedCache(model.config, pool=pool),
                                     max_new_tokens=NEW_TOKENS, do_sample=False)
                results[i] = (out, first_forward[threading.get_ident()])
            except Exception as err:  # pragma: no cover - reported below
                errors.append(err)

        handle = model.model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(runs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            handle.remove()
        assert not errors, errors
        for i, (inputs, expected) in enumerate(runs):
            out, computed = results[i]
            assert torch.equal(out, expected), f"thread {i}: tokens differ from DynamicCache"
            hit = expected_hit(inputs["input_ids"], warm_inputs["input_ids"])
            assert computed == inputs["input_ids"].shape[1] - hit, f"thread {i}: computed {computed} prompt tokens"
        assert pool.memory_stats().blocks_in_use == 0
        pool.allocator.check_invariants()
    finally:
        disable_paged_attention(model)


def test_prefix_caching_batch_rows_sharing_leading_columns():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(3)
    system = torch.randint(3, VOCAB, (1, 37), generator=g)

    def batch(*tails):
        return ones_mask(torch.cat([torch.cat([system, t[None]], 1) for t in tails]))

    first = batch(torch.randint(3, VOCAB, (6,), generator=g), torch.randint(3, VOCAB, (6,), generator=g))
    second = batch(torch.randint(3, VOCAB, (4,), generator=g), torch.randint(3, VOCAB, (4,), generator=g))
    padded = left_padded([9, 14], seed=4)
    # (padded: rows of different lengths share no leading columns: correct, no hit)
    expected = [generate(model, x, dynamic(model), max_new_tokens=6) for x in (first, second, padded)]
    enable_paged_attention(model, backend="torch")
    pool = BlockPool(block_size=16, prefix_caching=True)
    seen_per_call = []
    for x, e in zip((first, second, padded), expected):
        with decoder_token_counter(model) as seen:
            assert torch.equal(generate(model, x, PagedCache(model.config, pool=pool), max_new_tokens=6), e)
        seen_per_call.append(seen[0])
    assert seen_per_call[0] == first["input_ids"].shape[1]
    assert seen_per_call[1] == second["input_ids"].shape[1] - 32  # two whole blocks of the system prompt
    assert seen_per_call[2] == padded["input_ids"].shape[1]
    assert pool.memory_stats().prefix_hit_tokens == 2 * 32
    pool.allocator.check_invariants()


# ---------------------------------------------------------------------------------------------------------------------
# Prefix-caching allocator under eviction: a state machine with a shadow KV store
# ---------------------------------------------------------------------------------------------------------------------


class PrefixCachingMachine(RuleBasedStateMachine):
    """Requests start from shared prefixes with random suffixes, grow, fork, crop and end, on a small pool that keeps
    evicting cached blocks.

    The shadow store keeps, per slot, the prefix its KV was computed from (KV at position p depends on tokens
    0..p). A sequence's writes land in the store only when "its forward ran", i.e. at its next append, fork, crop or
    free (where the allocator publishes its keyed blocks). Every block a sequence's table reaches, and every block
    the prefix index names, must hold exactly that prefix: a block handed out before it was written, or a wrong key,
    shows up as another prefix's data.
    """

    NUM_BLOCKS = 8
    CROP = False
    ALPHABET = st.integers(0, 2)  # few token values: equal blocks under different parents are common

    @initialize(block_size=st.integers(2, 4), data=st.data())
    def setup(self, block_size, data):
        self.bs = block_size
        self.a = BlockAllocator(block_size, num_blocks=self.NUM_BLOCKS, prefix_caching=True)
        self.prefixes = [data.draw(st.lists(self.ALPHABET, min_size=n * block_size, max_size=n * block_size),
                                   label=f"prefix {n}") for n in (1, 2, 3)]
        self.prefixes.append(self.prefixes[1][:block_size] + self.prefixes[0])  # shares the first block of another
        self.tokens: dict[int, list[int]] = {}  # seq -> its token ids
        self.pending: dict[int, list[tuple[int, tuple]]] = {}  # seq -> (slot, prefix) writes of its unrun forward
        self.store: dict[int, tuple] = {}  # slot -> the prefix its KV came from
        self.prefix_of_key: dict[bytes, tuple] = {}

    # ----------------------------------------------------------------- helpers
    def run_forward(self, seq):
        for slot, prefix in self.pending.pop(seq, []):
            self.store[slot] = prefix

    def learn_keys(self, tokens):
        key = b""
        for i in range(len(tokens) // self.bs):
            key = block_key(key, tokens[i * self.bs: (i + 1) * self.bs])
            self.prefix_of_key[key] = tuple(tokens[: (i + 1) * self.bs])

    def append(self, seq, new_tokens) -> bool:
        """Append ``new_tokens`` to ``seq`` as a step planner does; False if the pool has no room."""
        a, bs = self.a, self.bs
        self.run_forward(seq)
        free_blocks, cached = len(a._free), a.num_cached
        try:
            plan = a.append([(seq, len(new_tokens))], [list(new_tokens)])
        except OutOfBlocksError as err:
            assert err.needed > free_blocks + cached, "refused although evictable cached blocks had room"
            return False
        for src, dst in plan.copies:  # copy-on-write runs before the forward, from written KV
            for off in range(bs):
                self.store.pop(dst * bs + off, None)
                if src * bs + off in self.store:
                    self.store[dst * bs + off] = self.store[src * bs + off]
        tokens = self.tokens[seq] + list(new_tokens)
        self.tokens[seq] = tokens
        self.learn_keys(tokens)
        for pos, slot in zip(range(plan.starts[0], len(tokens)), plan.slots[0]):
            self.store.pop(slot, None)  # the block may have been evicted from the cache: its old KV is gone
            self.pending.setdefault(seq, []).append((slot, tuple(tokens[: pos + 1])))
        return True

    def pick(self, data):
        return data.draw(st.sampled_from(sorted(self.tokens)), label="seq")

    # ------------------------------------------------------------------- rules
    @rule(data=st.data())
    def start_request(self, data):
        prompt = data.draw(st.sampled_from(self.prefixes), label="prefix") + data.draw(
            st.lists(self.ALPHABET, min_size=1, max_size=2 * self.bs), label="suffix")
        self.learn_keys(prompt)
        blocks = self.a.match_prefix(prompt, len(prompt) - 1)  # the last prompt token always runs
        for i, b in enumerate(blocks):  # what the request will read: this very prefix's KV
            for off in range(self.bs):
                pos = i * self.bs + off
                assert self.store.get(b * self.bs + off) == tuple(prompt[: pos + 1]), (
                    f"block {b} matched for positions {i * self.bs}.. holds another prefix's KV")
        seq = self.a.new_sequence(blocks)
        self.tokens[seq] = prompt[: len(blocks) * self.bs]
        if not self.append(seq, prompt[len(blocks) * self.bs:]):
            self.a.free(seq)  # the cache drops a request whose first step did not fit
            del self.tokens[seq]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append_tokens(self, data):
        seq = self.pick(data)
        self.append(seq, data.draw(st.lists(self.ALPHABET, min_size=1, max_size=self.bs + 1), label="tokens"))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = self.pick(data)
        self.run_forward(seq)
        self.a.free(seq)
        del self.tokens[seq]

    @precondition(lambda self: self.CROP and self.tokens)
    @rule(data=st.data())
    def crop(self, data):
        seq = self.pick(data)
        self.run_forward(seq)
        new_len = data.draw(st.integers(0, len(self.tokens[seq])), label="new_len")
        self.a.crop(seq, new_len)
        del self.tokens[seq][new_len:]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        seq = self.pick(data)
        self.run_forward(seq)
        child = self.a.fork(seq)
        self.tokens[child] = list(self.tokens[seq])

    # -------------------------------------------------------------- invariants
    @invariant()
    def bookkeeping_is_consistent(self):
        if not hasattr(self, "a"):
            return
        self.a.check_invariants()
        assert sorted(self.a.sequences) == sorted(self.tokens)

    @invariant()
    def every_read_returns_its_own_prefix(self):
        if not hasattr(self, "a"):
            return
        a, bs = self.a, self.bs
        pending = {slot for writes in self.pending.values() for slot, _ in writes}
        for seq, tokens in self.tokens.items():
            table = a.block_table(seq)
            assert a.seq_len(seq) == len(tokens) and NULL_BLOCK not in table
            for pos in range(len(tokens)):
                slot = table[pos // bs] * bs + pos % bs
                if slot not in pending:
                    assert self.store.get(slot) == tuple(tokens[: pos + 1]), (seq, pos, table)
        for key, block in a._block_of.items():  # every findable block holds the prefix its key names
            prefix = self.prefix_of_key[key]
            start = len(prefix) - bs
            for off in range(bs):
                assert self.store.get(block * bs + off) == prefix[: start + off + 1], f"block {block} is mis-keyed"

    def teardown(self):
        if not hasattr(self, "a"):
            return
        for seq in list(self.tokens):
            self.a.free(seq)
        self.a.check_invariants()
        assert self.a.blocks_in_use == 0
        assert self.a.num_free == self.NUM_BLOCKS, "blocks leaked"


class PrefixCachingMachineWithCrop(PrefixCachingMachine):
    CROP = True


MACHINE_SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None, derandomize=True,
                            suppress_health_check=[HealthCheck.too_slow])
TestPrefixCachingMachine = PrefixCachingMachine.TestCase
TestPrefixCachingMachine.settings = MACHINE_SETTINGS
TestPrefixCachingMachineWithCrop = PrefixCachingMachineWithCrop.TestCase
# shrinking a stateful failure takes minutes here: report the example as found
TestPrefixCachingMachineWithCrop.settings = settings(MACHINE_SETTINGS, phases=[Phase.explicit, Phase.generate])


def test_cropped_row_never_rewrites_a_cached_prefix_block():
    """A crops into a full block it shares with B (keyed, findable); B ends; A writes its next tokens there. A later
    request C matching that prefix must read the prefix's KV, not A's new tokens."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    prompt = torch.arange(10, 19)[None]  # 9 tokens: two full blocks of 4 and one partly filled
    b_ids = torch.cat([prompt[:, :8], torch.tensor([[50, 51]])], 1)
    c_ids = torch.cat([prompt[:, :8], torch.tensor([[60, 61]])], 1)
    expected = generate(model, ones_mask(c_ids), dynamic(model), max_new_tokens=4)
    enable_paged_attention(model, backend="torch")
    pool = BlockPool(block_size=4, num_blocks=32, prefix_caching=True)
    a = PagedCache(model.config, pool=pool)
    generate(model, ones_mask(prompt), a, max_new_tokens=2)  # A holds 10 tokens
    b = PagedCache(model.config, pool=pool)
    generate(model, ones_mask(b_ids), b, max_new_tokens=2)  # B starts from A's two full blocks
    assert b.memory_stats().prefix_hit_tokens == 8
    a.crop(-4)  # A keeps 6 tokens: its last block is the shared, keyed one holding tokens 4..7
    del b  # now only A holds that block
    generate(model, ones_mask(torch.cat([prompt[:, :6], torch.tensor([[90, 91]])], 1)), a, max_new_tokens=2)
    c = PagedCache(model.config, pool=pool)
    assert torch.equal(generate(model, ones_mask(c_ids), c, max_new_tokens=4), expected)
