"""MLA families (multi-head latent attention, :mod:`latent`): full attention on every layer, a YaRN-scaled softmax
scale (``scaling``), and the pool holding each token's latent and rotated key instead of per-head K/V."""

from .model_patch import ModelPatch
from .latent import latent_attention
from .windows import no_window

MLA_FAMILIES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "minicpm3", "youtu")  # each tested (tests/test_mla.py)

PATCHES = [
    ModelPatch((model_type,), model_type, features=("scaling",), window=no_window, attention=latent_attention)
    for model_type in MLA_FAMILIES
]
