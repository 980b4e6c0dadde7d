"""Images in the engine: a request's processor outputs turned into what its steps need.

One stage, :class:`MultimodalInputs`, with a small contract:

* ``prepare(inputs)`` (the manager, on the user's thread): one prompt's processor outputs (a mapping or a
  ``BatchFeature`` of batch 1: ``input_ids`` and the family's image tensors, ``pixel_values``, ``image_grid_thw``,
  ``image_sizes``, ``pixel_attention_mask``, ...) become a :class:`MediaPrompt`: the prompt ids, the image tensors,
  a digest of their content, the *key ids* prefix caching keys the prompt's blocks by (each image position holds a
  stand-in derived from the images' content instead of the placeholder id, so two requests with the same text and
  other images never share K/V and the same images do), and for models with multi-axis rotary positions (Qwen2/2.5/3-VL's
  mrope) the prompt's 3-axis positions from the model's own ``get_rope_index`` and the offset every later token's
  position carries.
* ``for_step(chunks, packed)`` (the runner, once per step): the forward's extra inputs, or None when the step has no
  image token and no 3-axis position to give. The image features are the model's own ``get_image_features`` output,
  computed once per image set at the first chunk that needs them, kept while the request's image tokens are being
  prefilled (an image may span several chunks) and in a bounded encoder cache keyed by content (LRU, ``max_bytes``),
  so a preempted request, or another with the same images, reuses them. The forward gets them through the model's
  own merge (``mm_encoder_outputs``: the rows of this step's image tokens, in token order, scattered by the model at
  its placeholder positions).
* ``done(chunks)`` (the runner, after the forward): requests past their last image token drop their features.

A generated token (or a text-only prompt's token) that happens to be the placeholder id is not an image token: the
model's merge would take it for one, so the step hands the model that id's own embedding for it (and zeros for
Qwen3-VL's deepstack rows): the forward computes what it would without images.
"""

from __future__ import annotations

import bisect
import hashlib
import inspect
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..patches import bidirectional_image_families, refused_image_families
from . import features

# Processor outputs that are not image tensors (the prompt and its masks).
PROMPT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})
VIDEO_KEYS = frozenset({"pixel_values_videos", "video_grid_thw", "second_per_grid_ts"})
DEFAULT_ENCODER_CACHE_BYTES = 256 << 20
_STAND_IN_SPAN = 1 << 62


def takes_images(model) -> bool:
    """Whether ``model`` has an image encoder the engine can run (``get_image_features``) and a placeholder id."""
    return hasattr(model, "get_image_features") and placeholder_id(model.config) is not None


def placeholder_id(config) -> int | None:
    """The id the processor repeats once per image token (``image_token_id`` / ``image_token_index``)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def content_digest(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """A 16-byte digest of the image tensors' names, dtypes, shapes and bytes."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


@dataclass(eq=False)
class Features:
    """One image set's encoder output, as rows in placeholder order."""

    rows: torch.Tensor  # [n, hidden] on the model's device, model dtype
    deepstack: list[torch.Tensor]  # [n, hidden] per deepstack layer (Qwen3-VL), else empty
    output_type: type  # the ModelOutput class get_image_features returned
    as_tuple: bool  # whether its pooler_output was a tuple / list of per-image tensors (else one tensor)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.rows, *self.deepstack))


@dataclass(eq=False)
class MediaPrompt:
    """One request's prompt with images (made by :meth:`MultimodalInputs.prepare`).

    ``key_ids`` are the ids its prompt blocks are keyed by (``Request.key_tokens``): the prompt, with every image
    position holding a stand-in drawn from ``digest``. ``text_from``: the first position after the last image token
    (from there on, a token's position is its index plus ``position_offset`` on every rotary axis).
    """

    tokens: list[int]
    tensors: dict[str, torch.Tensor]  # the image tensors, batch 1, on the host
    digest: bytes
    image_positions: list[int]  # prompt positions of the image tokens, ascending
    key_ids: list[int]
    # half-open ranges of the image tokens that attend to each other both ways (families whose image tokens do:
    # Gemma 3, one span per image), for Request.bidirectional_spans; empty for causal families
    bidirectional_spans: list[tuple[int, int]] = field(default_factory=list)
    mrope: torch.Tensor | None = None  # [3, L] int64: the prompt's 3-axis positions (models with mrope)
    position_offset: int = 0
    features: Features | None = field(default=None, repr=False)  # held while its image tokens are prefilled

    @property
    def text_from(self) -> int:
        return self.image_positions[-1] + 1

    def rows_in(self, start: int, end: int) -> tuple[int, int]:
        """The feature rows of the image tokens at positions ``[start, end)``."""
        return bisect.bisect_left(self.image_positions, start), bisect.bisect_left(self.image_positions, end)


def image_spans(token_type_ids, positions: list[int]) -> list[tuple[int, int]]:
    """Half-open ranges ``[start, end)`` of the prompt's images: the runs of ``token_type_ids == 1`` (batch 1, as
    Gemma 3's processor marks image tokens), else the runs of consecutive placeholder ``positions``."""
    if token_type_ids is not None:
        kinds = torch.as_tensor(token_type_ids).reshape(-1).tolist()
        positions = [i for i, k in enumerate(kinds) if k == 1]
    spans = []
    for p in positions:
        if spans and spans[-1][1] == p:
            spans[-1] = (spans[-1][0], p + 1)
        else:
            spans.append((p, p + 1))
    return spans


def position_offset(request) -> int:
    """What a request's token at or past its prompt's last image adds to its index to get its rotary position."""
    media = getattr(request, "media", None)
    return media.position_offset if media is not None else 0


@dataclass
class StepMedia:
    """A step's extra forward inputs (device tensors): what :meth:`forward_kwargs` hands the model."""

    encoder_outputs: object | None  # the ModelOutput for mm_encoder_outputs["image"], or None
    position_ids: torch.Tensor | None  # [3, 1, T + P] 3-axis positions, or None (the packed 1-D ones stand)

    def forward_kwargs(self) -> dict:
        kwargs = {}
        if self.encoder_outputs is not None:
            kwargs["mm_encoder_outputs"] = {"image": self.encoder_outputs}
        if self.position_ids is not None:
            kwargs["position_ids"] = self.position_ids
        return kwargs


class EncoderCache:
    """Encoder outputs by content digest, least recently used out past ``max_bytes`` (0: keeps nothing)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, Features] = OrderedDict()
        self.bytes = 0

    def get(self, digest: bytes) -> Features | None:
        features = self._entries.get(digest)
        if features is not None:
            self._entries.move_to_end(digest)
        return features

    def put(self, digest: bytes, features: Features) -> None:
        if features.nbytes > self.max_bytes or digest in self._entries:
            return
        self._entries[digest] = features
        self.bytes += features.nbytes
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


class MultimodalInputs:
    """The engine's image stage for ``model`` (see the module docstring).

    Args:
        model: an image-text-to-text model (``takes_images(model)``).
        encoder_cache_bytes: the encoder cache's budget (0: every image set is encoded again after its request's
            image tokens are prefilled, e.g. after a preemption).

    ``encoder_calls`` / ``encoder_hits``: image sets run through the vision encoder / found in the cache.

    Example::

        media = MultimodalInputs(model)
        prompt = media.prepare(processor(text=text, images=[image], return_tensors="pt"))
        prompt.key_ids  # the ids prefix caching keys its blocks by
    """

    def __init__(self, model, encoder_cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES):
        if not takes_images(model):
            raise ValueError(f"{type(model).__name__} has no image encoder (get_image_features) and placeholder id.")
        self.model = model
        self.model_type = getattr(model.config, "model_type", None)
        self.placeholder = placeholder_id(model.config)
        self.cache = EncoderCache(encoder_cache_bytes)
        self.encoder_calls = 0
        self.encoder_hits = 0
        params = inspect.signature(model.get_image_features).parameters
        self._encoder_args = frozenset(n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
        self._rope_index = getattr(model.base_model, "get_rope_index", None)  # the model's own mrope positions

    @property
    def mrope(self) -> bool:
        return self._rope_index is not None

    # --------------------------------------------------------------- prepare
    def prepare(self, inputs) -> MediaPrompt | None:
        """``inputs`` (a mapping of batch 1) as a :class:`MediaPrompt`; None when it holds no image tensors (then
        its ``input_ids`` are a plain prompt). ``ValueError`` naming what is wrong (a batch of several, videos,
        padding, placeholders without images, a family whose image tokens attend both ways)."""
        if "input_ids" not in inputs:
            raise ValueError("a request given as processor outputs needs 'input_ids' (got keys "
                             f"{sorted(inputs)}).")
        ids = torch.as_tensor(inputs["input_ids"])
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"processor outputs of one prompt (batch 1) are expected; input_ids has shape "
                             f"{tuple(ids.shape)}: add each prompt as its own request.")
        mask = inputs.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise ValueError("the prompt's attention_mask masks some tokens (padding): process each prompt alone, "
                             "without padding.")
        videos = sorted(VIDEO_KEYS & set(inputs))
        if videos:
            features.check({"videos"})
        tensors = {k: torch.as_tensor(v) for k, v in inputs.items() if k not in PROMPT_KEYS and v is not None}
        tokens = ids.tolist()
        positions = [i for i, t in enumerate(tokens) if t == self.placeholder]
        if not tensors:
            if positions:
                raise ValueError(f"the prompt holds {len(positions)} image placeholder(s) (id {self.placeholder}) "
                                 "but no image tensors: pass the processor's whole output (pixel_values, ...).")
            return None
        bidirectional = self.model_type in bidirectional_image_families()
        if self.model_type in refused_image_families():
            raise ValueError(f"{self.model_type}: its image tokens attend to each other both ways, which the "
                             "engine serves only for the families verified with bidirectional spans (gemma3). Fix: "
                             "run image prompts of this model through generate() (with a PagedCache or a "
                             "DynamicCache); text-only requests work here.")
        unknown = sorted(set(tensors) - self._encoder_args)
        if unknown:
            raise ValueError(f"{type(self.model).__name__}.get_image_features takes none of {unknown}; it takes "
                             f"{sorted(self._encoder_args)}.")
        if not positions:
            raise ValueError(f"image tensors were given but the prompt holds no image placeholder (id "
                             f"{self.placeholder}): build the prompt with the model's processor.")
        mrope, offset = self._positions(ids, inputs) if self._rope_index is not None else (None, 0)
        # the positions made the prompt's K/V too: two prompts whose images or positions differ never share blocks
        digest = content_digest(tensors if mrope is None else {**tensors, "\0positions": mrope})
        base = int.from_bytes(digest[:8], "little") % _STAND_IN_SPAN
        key_ids = list(tokens)
        for j, p in enumerate(positions):  # negative: never a real id
            key_ids[p] = -1 - (base + j) % _STAND_IN_SPAN
        media = MediaPrompt(tokens, tensors, digest, positions, key_ids, mrope=mrope, position_offset=offset)
        if bidirectional:
            media.bidirectional_spans = image_spans(inputs.get("token_type_ids"), positions)
        return media

    def _positions(self, ids: torch.Tensor, inputs) -> tuple[torch.Tensor, int]:
        """The prompt's 3-axis positions ``[3, L]`` and the offset every later position carries, as ``generate()``
        computes them for these inputs: the model's own ``_prepare_position_ids_for_generation`` (its
        ``get_rope_index`` when the inputs hold what it needs, e.g. ``mm_token_type_ids``, else plain positions) and
        the ``rope_deltas`` it leaves, which the decode steps of ``generate()`` add (the model's cached value is put
        back; a ``generate()`` on the same model in another thread at that instant could read the request's). A
        model without that method: its ``get_rope_index`` directly."""
        prepare = getattr(type(self.model), "_prepare_position_ids_for_generation", None)
        holder = self.model.base_model
        if prepare is not None and "rope_deltas" in vars(holder):
            kwargs = {k: torch.as_tensor(v) for k, v in inputs.items() if k != "input_ids" and v is not None}
            kwargs.setdefault("attention_mask", torch.ones(1, ids.shape[0], dtype=torch.long))
            kwargs["cache"] = None
            saved = holder.rope_deltas
            try:
                positions = prepare(self.model, ids[None], kwargs)  # [4, 1, L]: text positions, then the 3 axes
                delta = holder.rope_deltas
            finally:
                holder.rope_deltas = saved
            positions = positions[-3:, 0]
            delta = 0 if delta is None else int(torch.as_tensor(delta).reshape(-1)[0])
            return positions.cpu().long(), delta
        kinds = inputs.get("mm_token_type_ids")
        kinds = (ids == self.placeholder).int()[None] if kinds is None else torch.as_tensor(kinds).reshape(1, -1)
        args = {"input_ids": ids[None], "mm_token_type_ids": kinds, "attention_mask": None}
        if "image_grid_thw" in inputs:
            args["image_grid_thw"] = torch.as_tensor(inputs["image_grid_thw"])
        params = inspect.signature(self._rope_index).parameters
        args = {k: v for k, v in args.items() if k in params}
        positions, delta = self._rope_index(**args)  # [3, 1, L], [1, 1]
        return positions[:, 0].cpu().long(), int(delta.reshape(-1)[0])

    # ------------------------------------------------------------------ step
    def needed(self, chunks) -> bool:
        """Whether a step of ``chunks`` holds a prompt position of a request with images before its last image
        token's end (it needs image rows, or 3-axis positions)."""
        return any(c.request.media is not None and c.start < c.request.media.text_from for c in chunks)

    def for_step(self, chunks, position_ids: torch.Tensor, device) -> StepMedia | None:
        """The extra inputs of a step of ``chunks`` packed back to back (``position_ids`` ``[T + P]``: the packed
        1-D positions), or None when it needs none."""
        if not self.needed(chunks):
            return None
        at = 0
        segments = []  # in token order: (features, lo, hi) rows of a request's images, (None, 0, n) n stray ids
        three_axis = position_ids.expand(3, -1).clone() if self.mrope else None  # [3, T + P]
        for chunk in chunks:
            req, start, end = chunk.request, chunk.start, chunk.start + chunk.num_tokens
            media = req.media
            placeholders = chunk.tokens.count(self.placeholder)
            images = 0
            if media is not None and start < media.text_from:
                lo, hi = media.rows_in(start, end)
                images = hi - lo
                if images:
                    segments.append((self._features(media), lo, hi))
                if three_axis is not None and media.mrope is not None:
                    upto = min(end, len(media.tokens))
                    three_axis[:, at: at + upto - start] = media.mrope[:, start:upto]
            if placeholders > images:
                segments.append((None, 0, placeholders - images))
            at += chunk.num_tokens
        encoder_outputs = None
        if any(f is not None for f, _, _ in segments):
            encoder_outputs = self._encoder_outputs(segments, device)
        positions = three_axis[:, None].to(device) if three_axis is not None else None  # [3, 1, T + P]
        return StepMedia(encoder_outputs, positions)

    def _encoder_outputs(self, segments, device):
        """The model output holding this step's rows, in token order, as ``get_image_features`` gives them."""
        first = next(f for f, _, _ in segments if f is not None)
        stray = None
        rows, deep = [], [[] for _ in first.deepstack]
        for features, lo, hi in segments:
            if features is not None:
                rows.append(features.rows[lo:hi])
                for layer, d in zip(deep, features.deepstack):
                    layer.append(d[lo:hi])
                continue
            if stray is None:  # the placeholder id's own embedding: what the model computes for it without images
                ids = torch.tensor([self.placeholder], device=first.rows.device)
                stray = self.model.get_input_embeddings()(ids).to(first.rows.dtype)  # [1, hidden]
            rows.append(stray.expand(hi, -1))
            for layer in deep:
                layer.append(first.rows.new_zeros(hi, first.rows.shape[-1]))
        pooled = torch.cat(rows).to(device)  # [n, hidden]
        fields = {"pooler_output": (pooled,) if first.as_tuple else pooled}
        if first.deepstack:
            fields["deepstack_features"] = [(torch.cat(layer).to(device),) for layer in deep]
        return first.output_type(**fields)

    def _features(self, media: MediaPrompt) -> Features:
        """The request's encoder output: held, cached, or computed now (once per image set)."""
        if media.features is None:
            media.features = self.cache.get(media.digest)
            if media.features is not None:
                self.encoder_hits += 1
            else:
                media.features = self._encode(media)
                self.cache.put(media.digest, media.features)
        return media.features

    def _encode(self, media: MediaPrompt) -> Features:
        device = self.model.device
        args = {k: v.to(device) for k, v in media.tensors.items()}
        out = self.model.get_image_features(**args, return_dict=True)
        self.encoder_calls += 1
        pooled = out.pooler_output
        as_tuple = isinstance(pooled, (list, tuple))
        parts = list(pooled) if as_tuple else [pooled]
        hidden = parts[0].shape[-1]
        rows = torch.cat([p.reshape(-1, hidden) for p in parts])  # [n, hidden]
        if rows.shape[0] != len(media.image_positions):
            raise ValueError(f"the images give {rows.shape[0]} image tokens but the prompt holds "
                             f"{len(media.image_positions)} placeholders (id {self.placeholder}): build the prompt "
                             "and the images with the model's own processor.")
        deepstack = [torch.cat([p.reshape(-1, hidden) for p in layer])
                     for layer in (getattr(out, "deepstack_features", None) or [])]
        return Features(rows, deepstack, type(out), as_tuple)

    def done(self, chunks) -> None:
        """After a step's forward: requests whose image tokens are all computed drop their features (the encoder
        cache may keep them)."""
        for chunk in chunks:
            media = chunk.request.media
            if media is not None and media.features is not None and chunk.start + chunk.num_tokens >= media.text_from:
                media.features = None
