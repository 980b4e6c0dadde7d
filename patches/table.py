"""The family table: ``python -m hf_paged models`` prints it and docs/guide/families.md carries it
(regenerate with ``python -m hf_paged models --markdown``)."""

from __future__ import annotations

from .registry import GENERIC_VERIFIED, REFUSED, STATE_VERIFIED, _registry, generic_patch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from hf_paged import compat

from .support import available_features
from .vision import IMAGE_VERIFIED


def supported_models() -> list[dict]:
    """One row per model type the suite knows: ``model_type``, ``features`` (a patched family's), ``path``
    ("patch", "generic" or "refused"), ``status`` ("verified", what is missing, or the refusal), ``images``
    (vision-language families: how their images run in the engine; "-" for text models)."""
    have = available_features()
    rows = []
    for model_type, patch in sorted(_registry().items()):
        missing = [f for f in patch.features if f not in have]
        status = "verified" if not missing else "needs " + ", ".join(missing)
        if not patch.in_transformers():
            status = "not in this transformers"
        rows.append({"model_type": model_type, "features": patch.features, "path": "patch", "status": status})
    for model_type in GENERIC_VERIFIED:
        status = "verified" if generic_patch(model_type) is not None else "not in this transformers"
        rows.append({"model_type": model_type, "features": (), "path": "generic", "status": status})
    for model_type, mixer in STATE_VERIFIED.items():
        status = (f"verified (state layers: {mixer})"
                  if generic_patch(model_type) is not None else "not in this transformers")
        rows.append({"model_type": model_type, "features": ("state_layers",), "path": "generic", "status": status})
    for model_type, how in IMAGE_VERIFIED.items():  # vision-language models: their text model is paged as above
        status = "verified" if model_type in CONFIG_MAPPING_NAMES else "not in this transformers"
        rows.append({"model_type": model_type, "features": (), "path": "generic", "status": status,
                     "images": f"engine ({how})"})
    for model_type, why in REFUSED.items():
        rows.append({"model_type": model_type, "features": (), "path": "refused", "status": f"refused: {why}"})
    for row in rows:
        row.setdefault("images", "-")
    return sorted(rows, key=lambda r: (("patch", "generic", "refused").index(r["path"]), r["model_type"]))


GENERIC_NOTE = ("Any other model type whose attention goes through transformers' AttentionInterface is taken "
                "generically (kinds and shapes from its config; an attention argument that changes attention and hf_paged does not implement, "
                "or a layer kind it does not page, is refused by name).")


def format_models_table(markdown: bool = False) -> str:
    """The table ``python -m hf_paged models`` prints (``markdown=True``: the one in docs/guide/families.md)."""
    rows = supported_models()
    header = ("model type", "path", "features", "status", "images")
    lines = [(r["model_type"], r["path"], ", ".join(r["features"]) or "-", r["status"], r["images"]) for r in rows]
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(f"`{c}`" if i == 0 else c for i, c in enumerate(row)) + " |" for row in lines]
        return "\n".join(out) + "\n\n" + GENERIC_NOTE
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([*(fmt.format(*row).rstrip() for row in [header, *lines]), "", GENERIC_NOTE, "",
                      TRANSFORMERS_NOTE.format(installed=compat.TRANSFORMERS_VERSION, tested=compat.TESTED_RANGE)])


TRANSFORMERS_NOTE = ("transformers {installed} is installed; hf_paged is tested with transformers {tested} (a release "
                     "above that range runs with a warning: check its outputs against DynamicCache).")
