"""LoRA adapters for the tests and the benchmark: made with peft from random weights (B non-zero, so each adapter
changes the tokens), saved to directories as peft saves them, and the PeftModel oracle that loads them."""

from __future__ import annotations

from pathlib import Path

import torch

# three adapters of different ranks, targets, scalings (rslora, rank_pattern / alpha_pattern)
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=8, lora_alpha=16, target_modules=["o_proj", "gate_proj", "down_proj"], use_rslora=True),
    "c": dict(r=2, lora_alpha=6, target_modules=["q_proj", "k_proj", "up_proj"],
              rank_pattern={"layers.1.self_attn.q_proj": 6}, alpha_pattern={"up_proj": 3}),
}
B_SCALE = 0.3  # peft's random B (init_lora_weights=False) scaled so an adapter steers the tokens without swamping them


def save_adapters(make_model, directory: Path, specs: dict = ADAPTERS, seed: int = 100) -> dict[str, Path]:
    """Each adapter of ``specs`` made with peft on ``make_model()`` from seed ``seed + i``, saved under
    ``directory / name``; returns ``{name: path}``."""
    from peft import LoraConfig, get_peft_model

    paths = {}
    for i, (name, options) in enumerate(specs.items()):
        torch.manual_seed(seed + i)
        peft_model = get_peft_model(make_model(), LoraConfig(init_lora_weights=False, **options))
        with torch.no_grad():
            for key, param in peft_model.named_parameters():
                if "lora_B" in key:
                    param.mul_(B_SCALE)
        paths[name] = Path(directory) / name
        peft_model.save_pretrained(str(paths[name]))
    return paths


def peft_model(make_model, paths: dict[str, Path], active: str | None = None):
    """A ``PeftModel`` over a fresh ``make_model()`` holding every adapter of ``paths`` (``active`` set, default the
    first): the oracle a request of that adapter is compared with."""
    from peft import PeftModel

    names = list(paths)
    model = PeftModel.from_pretrained(make_model(), str(paths[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(paths[name]), adapter_name=name)
    model.set_adapter(active or names[0])
    return model.eval()
