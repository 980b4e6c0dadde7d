"""MLA (latent attention) helpers: tiny DeepSeek-shaped models, paged latent cases on scrambled block tables, the
float64 oracle (transformers' own expansion of the latent through ``kv_b_proj``, then attention in float64) and the
float32 error bound the absorbed attention must meet.

    model = tiny_mla_model("deepseek_v3")
    case = mla_case(model.model.layers[0].self_attn, [9, 30], [1, 5])
    bound = mla_error_bound(**case)
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_paged.ops import AttentionMetadata

from .models import BOS, EOS, PAD, VOCAB

# Three families with the layout transformers 5.24 shares (deepseek_v3's); ranks small, heads few, one MoE layer.
MLA_TYPES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite")
MLA_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=512, pad_token_id=PAD, eos_token_id=EOS,
                 bos_token_id=BOS, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                 v_head_dim=12, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                 topk_group=1, first_k_dense_replace=1)
F32_UNIT = 2.0 ** -24  # float32 unit roundoff


def tiny_mla_config(model_type: str = "deepseek_v3", **overrides):
    return AutoConfig.for_model(model_type, **{**MLA_SHAPE, **overrides})


def tiny_mla_model(model_type: str = "deepseek_v3", seed: int = 0, attn: str = "sdpa", **overrides):
    """An eval-mode model of :func:`tiny_mla_config` with weights drawn from ``seed``; generates with PAD and EOS."""
    torch.manual_seed(seed)
    config = tiny_mla_config(model_type, **overrides)
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model


def mla_case(module, seq_lens, q_lens, *, block_size: int = 8, seed: int = 0) -> dict:
    """A paged latent pool for ``module`` (an MLA attention) with each sequence's blocks at random physical places.

    Sequence ``s`` holds ``seq_lens[s]`` latents ``c`` ``[n, R]`` and rotated keys ``[n, P]``; its last ``q_lens[s]``
    positions are its queries ``[q, H, Dn + P]``. Unwritten slots are NaN; table entries past a sequence's blocks
    are -1. Returns the arguments of ``ops.mla.paged_mla`` plus the per-sequence latents (``latents``, ``ropes``).
    """
    gen = torch.Generator().manual_seed(seed)
    rank, rope = module.kv_lora_rank, module.qk_rope_head_dim
    heads, nope = module.num_heads, module.qk_nope_head_dim
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    physical = torch.randperm(num_blocks, generator=gen)
    latent_cache = torch.full((num_blocks, block_size, 1, rank), float("nan"))  # [blocks, block_size, 1, R]
    rope_cache = torch.full((num_blocks, block_size, 1, rope), float("nan"))  # [blocks, block_size, 1, P]
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    latents = [torch.randn(n, rank, generator=gen) for n in seq_lens]  # after kv_a_layernorm: unit scale
    ropes = [torch.randn(n, rope, generator=gen) for n in seq_lens]
    taken = 0
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[s, :nb] = physical[taken: taken + nb].to(torch.int32)
        taken += nb
        pos = torch.arange(n)
        blocks, offsets = block_tables[s, pos // block_size].long(), pos % block_size
        latent_cache[blocks, offsets, 0] = latents[s]
        rope_cache[blocks, offsets, 0] = ropes[s]
    query = torch.randn(sum(q_lens), heads, nope + rope, generator=gen)  # [T, H, Dn + P]
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    meta = AttentionMetadata(block_tables, torch.tensor(seq_lens, dtype=torch.int32), query_start_loc)
    proj = module.kv_b_proj
    return dict(query=query, kv_b_weight=proj.weight.detach(), kv_b_bias=proj.bias, nope_dim=nope,
                latent_cache=latent_cache, rope_cache=rope_cache, meta=meta, scale=module.scaling,
                module=module, latents=latents, ropes=ropes)


def _sequences(case):
    meta = case["meta"]
    for s, (c, r) in enumerate(zip(case["latents"], case["ropes"])):
        start, end = int(meta.query_start_loc[s]), int(meta.query_start_loc[s + 1])
        if end > start:
            yield start, end, c, r


def mla_float64(case, dtype=torch.float64) -> torch.Tensor:
    """``[T, H, Dv]``: per sequence, transformers' own ``expand_kv`` of the whole latent history (a float64 copy of
    the module), then causal softmax attention in ``dtype`` (float64: the oracle; transformers' eager attention
    would round its softmax to float32)."""
    module = case["module"]
    wide = _expander(module, dtype)
    out = torch.zeros(case["query"].shape[:2] + (module.v_head_dim,), dtype=dtype)
    for start, end, c, r in _sequences(case):
        n, q_len = c.shape[0], end - start
        with torch.no_grad():
            keys, values = wide.expand_kv(c.to(dtype)[None, None], r.to(dtype)[None, None])  # [1, H, n, D]
        q = case["query"][start:end].to(dtype).transpose(0, 1)  # [H, q, Dn + P]
        scores = (q @ keys[0].transpose(1, 2)) * case["scale"]  # [H, q, n]
        q_pos = torch.arange(n - q_len, n)
        scores = scores.masked_fill(torch.arange(n)[None, :] > q_pos[:, None], float("-inf"))
        out[start:end] = (scores.softmax(-1) @ values[0]).transpose(0, 1)  # [q, H, Dv]
    return out


def _expander(module, dtype):
    """A copy of ``module`` in ``dtype`` (its own ``expand_kv``, its own weights)."""
    return copy.deepcopy(module).to(dtype)


def mla_error_bound(case) -> torch.Tensor:
    """``[T, H, Dv]``: a bound on ``|paged_mla (float32) - mla_float64|``, from float32 rounding alone.

    With ``u = 2**-24`` and ``g(n) = n u / (1 - n u)`` (the classic bound on a length-``n`` dot product's error
    relative to the sum of the absolute products), for query ``i`` and head ``h``:

    1. ``q_lat = W_UK^T q_nope``: ``|dq_lat| <= g(Dn) |W_UK|^T |q_nope|``.
    2. ``s_t = scale (q_lat . c_t + q_rot . r_t)``: ``|ds_t| <= scale (|dq_lat| . |c_t| + g(R + P + 2)
       (|q_lat| . |c_t| + |q_rot| . |r_t|))``; ``D = max_t |ds_t|``.
    3. softmax: logits moved by at most ``D`` move each weight by a factor within ``exp(+-2D)``; exp, the sum over
       ``L`` positions and the division add ``g(L + 3)``: ``|dp_t| <= e_p p_t``, ``e_p = exp(2D) - 1 + g(L + 3)``.
    4. ``o = sum_t p_t c_t``: ``|do| <= (e_p + g(L) (1 + e_p)) sum_t p_t |c_t|``.
    5. ``out = W_UV o``: ``|dout| <= |W_UV| |do| + g(R) |W_UV| |o|``.

    Evaluated in float64 on the case's exact values, then doubled for the second-order terms left out above.
    """
    def g(n):
        return n * F32_UNIT / (1 - n * F32_UNIT)

    module = case["module"]
    heads, nope, rank = module.num_heads, case["nope_dim"], module.kv_lora_rank
    weight = case["kv_b_weight"].double().view(heads, -1, rank)
    w_uk, w_uv = weight[:, :nope], weight[:, nope:]  # [H, Dn, R], [H, Dv, R]
    bound = torch.zeros(case["query"].shape[:2] + (module.v_head_dim,), dtype=torch.float64)
    for start, end, c, r in _sequences(case):
        c, r = c.double(), r.double()
        n, q_len = c.shape[0], end - start
        q = case["query"][start:end].double()  # [q, H, Dn + P]
        q_nope, q_rot = q[..., :nope], q[..., nope:]
        q_lat = torch.einsum("qhd,hdr->qhr", q_nope, w_uk)
        dq_lat = g(nope) * torch.einsum("qhd,hdr->qhr", q_nope.abs(), w_uk.abs())
        ds = case["scale"] * (torch.einsum("qhr,nr->qhn", dq_lat, c.abs()) + g(rank + r.shape[1] + 2) * (
            torch.einsum("qhr,nr->qhn", q_lat.abs(), c.abs()) + torch.einsum("qhp,np->qhn", q_rot.abs(), r.abs())))
        scores = case["scale"] * (torch.einsum("qhr,nr->qhn", q_lat, c) + torch.einsum("qhp,np->qhn", q_rot, r))
        visible = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]  # [q, n]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        probs = scores.softmax(-1)  # [q, H, n]
        worst = ds.masked_fill(~visible[:, None], 0).amax(-1, keepdim=True)  # D per query and head
        e_p = torch.expm1(2 * worst) + g(n + 3)
        o = probs @ c  # [q, H, R]
        do = (e_p + g(n) * (1 + e_p)) * (probs @ c.abs())
        bound[start:end] = 2 * (torch.einsum("hvr,qhr->qhv", w_uv.abs(), do)
                                + g(rank) * torch.einsum("hvr,qhr->qhv", w_uv.abs(), o.abs()))
    return bound
