"""Vision-language families: which take images through the engine, and which differ from the generic image path.

The engine's image stage (``hf_paged/engine/multimodal.py``) is generic: the model's own ``get_image_features``, its
own merge (``mm_encoder_outputs``), its own ``get_rope_index`` where it has one. What it cannot do yet is named here.
"""

from __future__ import annotations

# Families whose image tokens attend to each other both ways (Gemma 3: within one image, from token_type_ids). The
# engine gives each image's tokens one bidirectional span (Request.bidirectional_spans: never split across chunks, a
# per-query visibility limit in the attention); the families verified that way are served, the others' image prompts
# are refused by name (text-only requests run).
BIDIRECTIONAL_IMAGES = frozenset({"gemma3", "gemma4", "gemma4_unified", "diffusion_gemma", "paligemma"})
SPANS_VERIFIED = frozenset({"gemma3"})

# Families the suite runs with images through the engine, token for token against generate() alone with a
# DynamicCache (tests/test_multimodal.py; tests/helpers/vlm.py has their tiny configs): model type -> how its images
# reach the language model.
IMAGE_VERIFIED = {
    "qwen2_5_vl": "mrope positions",
    "qwen3_vl": "mrope positions, deepstack",
    "llava": "image features",
    "idefics3": "image features",
    "smolvlm": "image features",
    "mistral3": "image features",
    "internvl": "image features",
    "gemma3": "image features, bidirectional image spans",
}


def bidirectional_image_families() -> frozenset[str]:
    """Model types whose image tokens attend to each other both ways (their image prompts get bidirectional spans)."""
    return BIDIRECTIONAL_IMAGES


def refused_image_families() -> frozenset[str]:
    """Model types whose image prompts the engine refuses: bidirectional ones not verified with spans."""
    return BIDIRECTIONAL_IMAGES - SPANS_VERIFIED
