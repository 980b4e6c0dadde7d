"""Model families: every supported architecture generates the same tokens as DynamicCache on the paged path; per-layer
windows agree with what the attention passes and with transformers' own cache; unsupported features are refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from helpers import FAMILIES, FAMILY_WINDOW, VOCAB, generate, left_padded, tiny_family_config, tiny_family_model
from hf_paged import PagedCache, enable_paged_attention
from hf_paged import patches
from hf_paged.patches import check_model, check_supported, find_patch_for_config, layer_windows, required_features

BLOCK_SIZE = 4
LENGTHS = [3, 27, 11]  # with 12 new tokens the longest row spans ~5 windows of 8
WINDOW = FAMILY_WINDOW  # every sliding family's window in FAMILIES

# families the installed transformers has (4.56 lacks some, and routes StableLM's attention through its own classes)
AVAILABLE = sorted(m for m in FAMILIES if patches._registry()[m].in_transformers())


@pytest.mark.parametrize("model_type", AVAILABLE)
def test_family_matches_dynamic_cache_greedy_and_beams(model_type):
    model = tiny_family_model(model_type)
    inputs = left_padded(LENGTHS, seed=1)
    runs = {"greedy": dict(max_new_tokens=12), "beams": dict(max_new_tokens=8, num_beams=2)}
    expected = {name: generate(model, inputs, DynamicCache(config=model.config), **kw) for name, kw in runs.items()}
    enable_paged_attention(model, backend="torch")
    for name, kw in runs.items():
        got = generate(model, inputs, PagedCache(model.config, block_size=BLOCK_SIZE), **kw)
        assert got.shape[1] > inputs["input_ids"].shape[1], f"{model_type} {name}: nothing generated"
        assert torch.equal(got, expected[name]), f"{model_type} {name}: tokens differ from DynamicCache"


@pytest.mark.parametrize(
    ("model_type", "without_feature"),
    [
        ("gemma2", dict(attn_logit_softcapping=None)),
        ("gemma2", dict(layer_types=["full_attention"] * 2)),
        ("gemma3_text", dict(layer_types=["full_attention"] * 2)),
        ("gpt_oss", dict(layer_types=["full_attention"] * 2)),
    ],
)
def test_family_configs_exercise_their_features(model_type, without_feature):
    """The equality test above only proves soft-cap and windows work if dropping them changes the tokens."""
    inputs = left_padded(LENGTHS, seed=1)
    outputs = []
    for overrides in ({}, without_feature):
        model = tiny_family_model(model_type, **overrides)
        outputs.append(generate(model, inputs, DynamicCache(config=model.config)))
    assert not torch.equal(*outputs)


def test_gpt_oss_sinks_change_the_tokens():
    inputs = left_padded(LENGTHS, seed=1)
    model = tiny_family_model("gpt_oss")
    with_sinks = generate(model, inputs, DynamicCache(config=model.config))
    for layer in model.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)  # exp(-1e4) = 0: no sink
    assert not torch.equal(with_sinks, generate(model, inputs, DynamicCache(config=model.config)))


def _record_windows(model) -> list:
    """Run one forward and record the ``sliding_window=`` each layer's attention passes."""
    seen = {}
    original = model.config._attn_implementation
    attention = ALL_ATTENTION_FUNCTIONS.get(original) or patches.find_patch(model).eager_attention

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = kwargs.get("sliding_window")
        return attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("hf_paged_test_record", recording)
    ALL_MASK_ATTENTION_FUNCTIONS.register("hf_paged_test_record", ALL_MASK_ATTENTION_FUNCTIONS[original])
    model.set_attn_implementation("hf_paged_test_record")
    with torch.no_grad():
        model(**left_padded([5, 3]))
    return [seen[i] for i in range(model.config.num_hidden_layers)]


@pytest.mark.parametrize("model_type", AVAILABLE)
def test_layer_windows_match_attention_and_dynamic_cache(model_type):
    model = tiny_family_model(model_type)
    windows = layer_windows(model.config)
    assert windows == _record_windows(model)
    # transformers' cache builds a sliding layer holding the same W on exactly those layers (it keeps W - 1 tokens)
    assert windows == [getattr(layer, "sliding_window", None) for layer in DynamicCache(config=model.config).layers]
    if FAMILIES[model_type].get("sliding_window"):
        assert WINDOW in windows


@pytest.mark.parametrize(
    ("model_type", "overrides", "expected"),
    [
        ("qwen2", dict(num_hidden_layers=4, max_window_layers=2), [None, None, WINDOW, WINDOW]),
        ("qwen2", dict(use_sliding_window=False), [None, None]),
        ("smollm3", dict(use_sliding_window=False, layer_types=None), [None, None]),
        ("smollm3", dict(use_sliding_window=False), [WINDOW, None]),  # attention passes None; the mask slides
        ("mistral", dict(sliding_window=None), [None, None]),
        ("gemma3_text", dict(num_hidden_layers=6, layer_types=None), [WINDOW] * 5 + [None]),
        ("cohere2", dict(num_hidden_layers=4, layer_types=None), [WINDOW] * 3 + [None]),
        ("exaone4", dict(num_hidden_layers=4, layer_types=None), [WINDOW] * 3 + [None]),
        ("gpt_oss", dict(num_hidden_layers=4, layer_types=None), [WINDOW, None, WINDOW, None]),
    ],
)
def test_layer_windows_rules(model_type, overrides, expected):
    config = tiny_family_config(model_type, **overrides)
    assert layer_windows(config) == expected
    dynamic = [getattr(layer, "sliding_window", None) for layer in DynamicCache(config=config).layers]
    assert dynamic == expected


def test_layer_windows_unknown_model_type_reads_config_generically():
    layered = AutoConfig.for_model("gemma3n_text")  # not a registered family: its layer_types decide
    assert layer_windows(layered) == [layered.sliding_window if t == "sliding_attention" else None
                                      for t in layered.layer_types]
    plain = AutoConfig.for_model("gpt_neox", num_hidden_layers=3)
    assert layer_windows(plain) == [None, None, None]


def test_multimodal_gemma3_found_through_text_config():
    config = AutoConfig.for_model("gemma3")
    assert find_patch_for_config(config).model_types == ("gemma3_text",)
    assert layer_windows(config) == layer_windows(config.text_config)


def test_required_features_follow_the_config():
    assert required_features(tiny_family_config("llama")) == ()
    assert required_features(tiny_family_config("mistral")) == ("sliding_window",)
    assert required_features(tiny_family_config("gemma2")) == ("sliding_window", "layer_windows", "softcap")
    assert required_features(tiny_family_config("gemma2", attn_logit_softcapping=None, layer_types=None,
                                                sliding_window=None)) == ()
    assert required_features(tiny_family_config("gpt_oss")) == ("sliding_window", "layer_windows", "sinks")
    assert "layer_windows" not in required_features(tiny_family_config("gemma3_text", layer_types=["sliding_attention"] * 2))


@pytest.mark.parametrize(
    ("make_config", "feature"),
    [
        (lambda: tiny_family_config("qwen2", v_head_dim=8), "different key and value head sizes"),
        # MLA families with a latent attention are paged (tests/test_mla.py); the others are refused by name
        (lambda: AutoConfig.for_model("longcat_flash"), "multi-head latent attention"),
        (lambda: AutoConfig.for_model("gemma3_text", use_bidirectional_attention=True), "bidirectional attention"),
    ],
    ids=["kv_head_sizes", "latent_attention", "bidirectional"],
)
def test_check_supported_refuses_named_feature(make_config, feature):
    config = make_config()
    for paged in (True, False):
        with pytest.raises(ValueError, match=feature) as err:
            check_supported(config, paged=paged)
        assert "Fix:" in str(err.value)


def test_check_supported_accepts_every_family_when_features_exist(monkeypatch):
    everything = frozenset({"scaling", "sliding_window", "layer_windows", "softcap", "sinks"})
    monkeypatch.setattr(patches.support, "available_features", lambda: everything)
    for model_type in AVAILABLE:
        check_supported(tiny_family_config(model_type))


def test_check_supported_refuses_missing_ops_features_with_the_fix(monkeypatch):
    monkeypatch.setattr(patches.support, "available_features", lambda: frozenset({"scaling", "sliding_window"}))
    with pytest.raises(ValueError, match="softcap.*gathered mode"):
        check_supported(tiny_family_config("gemma2", layer_types=["sliding_attention"] * 2))
    with pytest.raises(ValueError, match="sinks"):
        check_supported(tiny_family_config("gpt_oss", layer_types=["full_attention"] * 2))
    with pytest.raises(ValueError, match="layer_windows.*DynamicCache"):
        check_supported(tiny_family_config("cohere2"))
    check_supported(tiny_family_config("gemma2"), paged=False)  # gathered mode runs the model's own attention
    check_supported(tiny_family_config("mistral"))


def test_model_without_head_dim_refused_before_any_forward():
    config = AutoConfig.for_model("gpt_neox", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64)
    model = AutoModelForCausalLM.from_config(config).eval()

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran before the refusal")

    model.forward = no_forward
    with pytest.raises(ValueError, match="head_dim.*gathered mode"):
        check_model(model)
    with pytest.raises(ValueError, match="GPTNeoXAttention .*head_dim"):
        enable_paged_attention(model)
    check_supported(config, paged=False)  # gathered mode needs no module attributes


def test_models_command_lists_every_family():
    out = subprocess.run([sys.executable, "-m", "hf_paged", "models"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:] if line.strip()}
    assert set(FAMILIES) <= set(rows)
    assert "softcap" in rows["gemma2"] and "sinks" in rows["gpt_oss"]
    assert "verified" in rows["llama"].split()  # its status column (the images column follows)
