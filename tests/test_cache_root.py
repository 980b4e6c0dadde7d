"""Key-chain roots: blocks written under one root (an adapter, a weights version) are never found under another."""

from hf_paged.allocator import BlockAllocator, root_key


def _write(a: BlockAllocator, seq: int, tokens: list[int]) -> None:
    a.append([(seq, len(tokens))], [tokens])


def test_root_separates_prefix_cache_entries():
    a = BlockAllocator(num_blocks=16, block_size=4, prefix_caching=True)
    tokens = list(range(12))
    adapter = root_key("adapter", "a")
    assert adapter != b"" and root_key() == b"" and root_key("adapter", "a") == adapter
    seq = a.new_sequence(root=adapter)
    _write(a, seq, tokens)
    a.free(seq)
    assert a.match_prefix(tokens) == []  # nothing under the default root
    assert len(a.match_prefix(tokens, root=adapter)) == 3
    assert a.match_prefix(tokens, root=root_key("adapter", "b")) == []
    child = a.new_sequence(a.match_prefix(tokens, root=adapter), root=adapter)
    fork = a.fork(child)
    _write(a, fork, [99, 98, 97, 96])
    a.free(child)
    a.free(fork)
    assert len(a.match_prefix(tokens + [99, 98, 97, 96], root=adapter)) == 4  # the fork kept the root
    assert a.match_prefix(tokens + [99, 98, 97, 96]) == []
