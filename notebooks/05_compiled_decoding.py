# %% [markdown]
# # Compiled decoding
#
# transformers compiles the decoding forward of `generate()` when it is given a `compile_config` (on CUDA it does so by
# itself for compileable caches). A `PagedCache` can be compiled when its pool has a fixed size, so that its tensors
# are allocated once and never move:
#
# ```python
# enable_paged_attention(model)
# cache = PagedCache(model.config, num_blocks=N)          # a fixed pool: N blocks, all taken before the compiled call
# cc = CompileConfig(fullgraph=True)                       # fullgraph: a graph break is an error, not a slowdown
# cc._compile_all_devices = True                           # CPU needs it; on CUDA transformers compiles by itself
# model.generate(**inputs, cache=cache, compile_config=cc)
# ```
#
# Compiling takes a while on a CPU. **Quick mode** (`HF_PAGED_NB_QUICK=1`, how the stored outputs were made) uses a tiny
# random-weight Llama (2 layers) with dynamo's `aot_eager` backend, which traces the whole forward as inductor would
# but generates no code. **Full mode** runs the embedded SmolLM2-135M-Instruct with inductor. The first cell's output
# says which mode ran.

# %%
import math
import os
import time
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: text bars

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig
from transformers.generation import CompileConfig

from hf_paged import PagedCache, embedded_model_dir, enable_paged_attention

QUICK = os.environ.get("HF_PAGED_NB_QUICK") == "1"  # set by CI and notebooks/run.py: a smaller run
NUM_PROMPTS, MAX_NEW_TOKENS, BACKEND = (3, 16, "aot_eager") if QUICK else (4, 48, "inductor")
print(f"{'quick' if QUICK else 'full'} mode: torch.compile backend {BACKEND!r}, {NUM_PROMPTS} prompts x "
      f"{MAX_NEW_TOKENS} new tokens; torch {torch.__version__}, transformers {transformers.__version__}")

# %%
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

# %% [markdown]
# ## The reference, and the pool size
#
# Greedy decoding with transformers' `DynamicCache`, eagerly, gives the tokens every compiled run must reproduce. The
# fixed pool must hold every row's prompt and new tokens: `rows x ceil((prompt + new tokens) / block_size)` blocks (a
# pool too small raises `OutOfBlocksError`, saying how many blocks were needed).

# %%
expected = model.generate(**inputs, cache=DynamicCache(config=model.config), max_new_tokens=MAX_NEW_TOKENS,
                          do_sample=False)

BLOCK_SIZE = 16
rows, columns = inputs["input_ids"].shape
NUM_BLOCKS = rows * math.ceil((columns + MAX_NEW_TOKENS) / BLOCK_SIZE)
print(f"pool: {NUM_BLOCKS} blocks of {BLOCK_SIZE} tokens for {rows} rows of up to {columns + MAX_NEW_TOKENS} tokens")

# %% [markdown]
# ## Compiled calls
#
# Three `generate()` calls, each on a new `PagedCache` with the same fixed size. transformers runs the prefill eagerly
# and the one-token decoding steps through the compiled forward; the first call pays for compiling (dynamo traces the
# forward a few times while it learns which sizes vary), later calls reuse the graphs. An eager paged call
# (`disable_compile=True`) is timed beside them.

# %%
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
print(f"\nfirst call / later calls: {seconds['compiled, 1st (compiles)'] / later:.0f}x")

# %% [markdown]
# Do not expect a speed-up here: with `aot_eager` (quick mode) the compiled forward runs the same operations as the
# eager one, and on a CPU even inductor's code gains little for a small model (full mode, on a busy 2-core machine:
# about 16 s per compiled call vs 14 s eager, after a first call of about 7 minutes). The gain from compiling comes on
# a GPU, where the decoding step is launch-bound (`bench/generate.py` section 3 measures it, against `StaticCache`
# compiled). What this shows is that the paged cache runs inside the compiled graph (`fullgraph=True`: no graph
# breaks), gives the same tokens, and compiles once.
#
# ## A pool that grows cannot be compiled
#
# Without `num_blocks=` (or `max_memory=`) the pool grows on demand, reallocating its tensors, which a compiled graph
# cannot follow. `generate()` then warns and runs eagerly; the tokens are the same.

# %%
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    transformers.logging.set_verbosity_error()  # transformers also logs that it skips compilation
    out, secs = timed_generate(PagedCache(model.config, block_size=BLOCK_SIZE), compile_config=cc)
    transformers.logging.set_verbosity_warning()
for warning in caught:
    print(f"{warning.category.__name__}: {warning.message}")
print(f"\nran eagerly in {secs:.2f} s; tokens equal to DynamicCache: {torch.equal(out, expected)}")
