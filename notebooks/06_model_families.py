# %% [markdown]
# # Model families
#
# `enable_paged_attention` works on every family in the table below. Beyond plain Llama-style attention, the paged path
# handles the features some families add:
#
# * **sliding windows**, on every layer or on some (Qwen2, Gemma2/3, gpt-oss): a layer with a window reads only its
#   last `W` tokens, and the cache gives back blocks that slid out;
# * **logit soft-capping** (Gemma2): `tanh(scores / cap) * cap` before the softmax;
# * **attention sinks** (gpt-oss): a learned per-head logit added to the softmax's denominator.
#
# Each family below is a tiny random-weight model built from its transformers config (2 layers, hidden size 64), checked
# token for token against `DynamicCache`. Random weights generate gibberish, but the same gibberish is the test.

# %%
import os
import subprocess
import sys
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: text bars

import matplotlib.pyplot as plt
import torch
from transformers import DynamicCache

from hf_paged import PagedCache, enable_paged_attention

QUICK = os.environ.get("HF_PAGED_NB_QUICK") == "1"  # set by CI and notebooks/run.py: a smaller run
NEW_TOKENS, HYBRID_PROMPT = (16, 160) if QUICK else (48, 600)  # new tokens; prompt length in the hybrid example
plt.rcParams.update({"figure.dpi": 60, "font.size": 9})  # small inline PNGs

# `python -m hf_paged models`: the supported families, the features each may need, and whether this transformers has it.
print(subprocess.run([sys.executable, "-m", "hf_paged", "models"], check=True, capture_output=True, text=True).stdout)

# %% [markdown]
# ## Four families against `DynamicCache`
#
# A left-padded batch of three random prompts; windows of 8 tokens so that the 40-token rows slide several times.
# Gemma2 and gpt-oss run transformers' `eager` attention for the reference (their models do not support SDPA, which
# has no soft-capping or sinks).

# %%
sys.path.insert(0, os.path.abspath("../tests"))  # the tests' shared helpers: tests/test_models.py's tiny models
from helpers import FAMILIES, left_padded, tiny_family_model

FOUR = ["qwen2", "gemma2", "gemma3_text", "gpt_oss"]
for model_type in FOUR:  # what each family's config adds to the tiny shape (2 layers, hidden size 64, head_dim 16)
    print(f"  {model_type}: {FAMILIES[model_type]}")
inputs = left_padded([8, 24, 15], seed=1)  # three random prompts, left-padded to 24 columns
settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False)

print(f"{'family':<12} {'soft-cap':>8} {'sinks':>5}  {'layer groups (window: blocks in use)':<38} tokens equal")
for model_type in FOUR:
    model = tiny_family_model(model_type)
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

# %% [markdown]
# Layers with different windows keep separate block tables (one per *layer group*), drawing blocks from the same pool:
# a sliding group holds the few blocks its window spans per row, a full group all of the row's tokens.
#
# ## Memory of a hybrid model: Gemma3-like, five sliding layers to one full
#
# Gemma 3 alternates five sliding-window layers with one full-attention layer. With a long prompt most layers need only
# their window. Here a 6-layer Gemma3 text model (window 32, block size 16) reads a long prompt; the memory at the end
# is compared between:
#
# * `PagedCache` on the hybrid model, per layer group (`cache.memory_stats().groups`);
# * `DynamicCache` on the same model (the keys and values tensors of `cache.layers`: its sliding layers keep their last
#   `W - 1` tokens, padded rows included);
# * `PagedCache` on the same model with every layer full, what the KV would be without windows.
#
# Groups are cut to one size, as in vLLM's hybrid allocator, so that a block costs the same bytes in any group: here
# five sliding groups and one full group of one layer each.

# %%
HYBRID = ["sliding_attention"] * 5 + ["full_attention"]
hybrid = tiny_family_model("gemma3_text", num_hidden_layers=6, layer_types=HYBRID, sliding_window=32,
                           max_position_embeddings=2048)
all_full = tiny_family_model("gemma3_text", num_hidden_layers=6, layer_types=["full_attention"] * 6,
                             max_position_embeddings=2048)
long_inputs = left_padded([HYBRID_PROMPT, HYBRID_PROMPT * 3 // 4], seed=2)  # the second row a quarter padding
for m in (hybrid, all_full):
    m.generation_config.eos_token_id = None  # every row runs to the end: the memory at full length

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
print(f"\n{len(stats.groups)} layer groups of {layers_per_group} layer(s)\n{'group':<6} {'window':>6} "
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

# %%
fig, ax = plt.subplots(figsize=(6, 2.2))
labels = list(kv_bytes)
ax.barh(labels, [kv_bytes[k] / 1e3 for k in labels], color=["C0", "C1", "C7"])
ax.invert_yaxis()
ax.set(xlabel="KV bytes held at the end (KB)", title=f"Gemma3-like, 5 sliding (W=32) + 1 full layer, "
       f"{HYBRID_PROMPT}-token prompt")
fig.tight_layout()
plt.show()

# %% [markdown]
# Both hybrid caches hold a fraction of the all-full KV: the windows do the saving. Between the two, a paged sliding
# layer holds whole blocks (a window of 32 spans up to three blocks of 16 per row) where `DynamicCache` keeps exactly
# `W - 1` tokens, while `DynamicCache`'s full layer stores the padding of short rows and the paged one does not; which
# wins depends on the window, the block size and the spread of prompt lengths.
