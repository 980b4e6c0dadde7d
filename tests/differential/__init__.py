"""The differential tester (issue 51): "the engine gives each request what generate() gives it alone", searched for.

From a seed it draws a case (``draw.py``): a tiny random model of one family (plain llama, sliding-window, MoE,
latent attention, hybrid, multi-axis-rope VLMs Qwen2-VL / Qwen2.5-VL / Qwen3-VL, Gemma-3-style bidirectional VLM,
LLaVA), engine conditions (block size, a step budget that chunks prompts mid-image, a pool small enough to preempt,
prefix caching, n-gram or draft-model speculation, LoRA adapters loaded or a PeftModel served) and a mix of requests
(greedy, seeded sampling with warpers, beams, prompt lookup, processors and penalties, several EOS ids, min length,
adapters, images of several grids anywhere in the prompt), in one or two phases on one shared pool (prefix hits,
evictions, weights changed between phases). ``run.py`` serves each phase in one engine and compares each request
with ``generate()`` of that request alone on a ``DynamicCache``; on a difference it shrinks the case (fewer phases
and requests, a plainer engine, fewer settings, shorter prompts) and ``fuzz.py`` prints a reproducer.

    make fuzz SEED=3 TRIALS=50                          # or: cd tests && python -m differential --seed 3 --trials 50
    make fuzz SEED=3 TRIALS=50 FAMILIES=qwen2_vl,llama

Models are cached per (family, seed) for the run (building them is most of a trial's cost). Case ``t`` of seed ``S``
is drawn from ``S * 100003 + t``, so a run is repeatable and one trial can be rerun alone.
"""
