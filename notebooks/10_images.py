# %% [markdown]
# # Images through the engine: vision-language requests with continuous batching
#
# A vision-language model's request is one prompt's processor outputs: `input_ids`, where the processor repeats an
# image placeholder once per image token, and the image tensors. `hf_paged.generate_batch` and
# `manager.add_request` take them as they come; text-only requests share the same steps. The engine encodes each
# image once (the model's own `get_image_features`), hands its rows to the model's own merge chunk by chunk, gives
# Qwen-VL models their 3-axis rotary positions, and keys prefix-cache blocks by the images' content.
#
# This notebook uses a tiny random-weight Qwen2.5-VL (the tests' factory; nothing is downloaded): the point is the
# mechanics, checked token for token against `generate()` alone with a `DynamicCache`.

# %%
import os
import sys
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: text bars

import torch
import transformers

import hf_paged
from hf_paged import BlockPool

sys.path.insert(0, os.path.abspath("../tests"))  # the tests' shared helpers: tiny VLMs and their processor outputs
from helpers.vlm import IMAGE, tiny_vlm, vlm_prompt, vlm_reference

transformers.logging.disable_progress_bar()
print(f"hf_paged {hf_paged.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
model = tiny_vlm("qwen2_5_vl")
print(type(model).__name__, f"{sum(p.numel() for p in model.parameters()):,} parameters, placeholder id {IMAGE}")

# %% [markdown]
# Four requests: the same question about two different pictures, a question with two pictures, and a text-only
# prompt. Each image here is a random tensor standing for what the processor makes of a picture
# (`pixel_values` and `image_grid_thw` for Qwen2.5-VL).

# %%
question = [[2, 11, 12, 13], [14, 15, 16, 17]]  # text before and after the image
prompts = [vlm_prompt("qwen2_5_vl", question, [1]),
           vlm_prompt("qwen2_5_vl", question, [2]),
           vlm_prompt("qwen2_5_vl", [[2, 11], [12, 13], [14, 15]], [3, 4]),
           [2, 21, 22, 23, 24]]
for i, p in enumerate(prompts):
    if isinstance(p, list):
        print(f"request {i}: {len(p)} text tokens")
    else:
        n = int((p["input_ids"] == IMAGE).sum())
        print(f"request {i}: {p['input_ids'].shape[1]} tokens, {n} of them image tokens; tensors "
              + ", ".join(f"{k} {tuple(v.shape)}" for k, v in p.items() if k.startswith(("pixel", "image"))))

# %%
outputs = hf_paged.generate_batch(model, prompts, max_new_tokens=12, max_batch_tokens=8, progress_bar=False)
alone = [vlm_reference(model, p if not isinstance(p, list) else {"input_ids": torch.tensor([p])}, 12)
         for p in prompts]
for (rid, out), ref in zip(outputs.items(), alone):
    print(f"{rid}: {out.generated_tokens}  equal to generate() alone: {out.generated_tokens == ref}")
print("same question, different pictures, different answers:",
      outputs["req_0"].generated_tokens != outputs["req_1"].generated_tokens)

# %% [markdown]
# Image-aware prefix caching: with a pool that keeps finished prompts' blocks, asking again about the same picture
# finds the blocks holding the image (keyed by the image's content), so neither those tokens nor the vision encoder
# run again; the same text with another picture shares only the blocks before the image.

# %%
pool = BlockPool(num_blocks=64, block_size=4, prefix_caching=True)
for label, prompt in [("picture 1", prompts[0]), ("picture 1 again", vlm_prompt("qwen2_5_vl", question, [1])),
                      ("picture 2", prompts[1])]:
    with hf_paged.init_continuous_batching(model, pool=pool) as manager:
        out = manager.get_result(manager.add_request(prompt, max_new_tokens=12), timeout=120)
        stats = manager.stats()
    print(f"{label:16} prompt {len(out.prompt_ids)} tokens, from the prefix cache {stats.prefix_hit_tokens:2}, "
          f"vision encoder runs {stats.encoder_calls}, tokens equal to generate() alone: "
          f"{out.generated_tokens == vlm_reference(model, prompt, 12)}")
