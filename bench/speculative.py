"""Speculative decoding in the engine, on an input-grounded workload: does it pay, and does the policy stop it where
it does not?

Workload: C concurrent requests (C = 1, 4, 16 by default), each asking the embedded SmolLM2-135M-Instruct to copy out
a passage of a given text with one word changed -- the output repeats the input, so prompt lookup finds its drafts.
Greedy, so every contender gives the same tokens (checked). Contenders, alternated per concurrency level, each on its
own warmed engine (one warm-up round first, so the policy has measured this machine's step costs):

- ``plain``: no speculation;
- ``ngram``: prompt lookup (``speculative="ngram"``), the policy on;
- ``ngram-always``: the same with the policy forced on (what speculation costs where the policy would not run it);
- ``draft``: a draft model sharing the tokenizer -- the target's first ``--draft-layers`` layers and its head
  (no smaller SmolLM2 is stored here), the policy on.

Reported: output tokens/s, the ratio to ``plain``, draft tokens accepted per verifying request-step, and the share of
steps that speculated.

    python bench/speculative.py [--concurrency 1 4 16] [--max-new-tokens 48] [--draft-layers 10] [--contenders ...]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hf_paged import BlockPool, attach_paged_attention, embedded, init_continuous_batching  # noqa: E402
from hf_paged.report import cpu_name, format_table  # noqa: E402

SENTENCES = [s.strip() + "." for s in embedded.STORY.split(". ") if s.strip()]


def prompts(tokenizer, n: int, offset: int) -> list[list[int]]:
    """``n`` chat prompts, each a different passage of the story to copy out with one word changed."""
    out = []
    for i in range(n):
        start = (offset + i) % (len(SENTENCES) - 2)
        passage = " ".join(SENTENCES[start: start + 3])
        text = (f"Copy out the following text exactly, but write 'harbor' instead of 'harbour' if it appears.\n\n"
                f"{passage}")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def draft_model(model, layers: int):
    """The target's first ``layers`` layers, its final norm and head: a draft with the same tokenizer."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    missing, _ = draft.load_state_dict(model.state_dict(), strict=False)
    assert not [k for k in missing if "rotary" not in k], missing
    return draft.eval()


def run(manager, batch: list[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
    ids = [manager.add_request(p, max_new_tokens=max_new_tokens) for p in batch]
    start = time.perf_counter()
    outs = [manager.get_result(rid) for rid in ids]
    return time.perf_counter() - start, [o.generated_tokens for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    parser.add_argument("--draft-layers", type=int, default=10)
    parser.add_argument("--draft-tokens", type=int, default=4, help="draft tokens per step of the draft model")
    parser.add_argument("--contenders", nargs="+", default=["plain", "ngram", "ngram-always", "draft"])
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = embedded.load()
    attach_paged_attention(model)
    draft = attach_paged_attention(draft_model(model, args.draft_layers)) if "draft" in args.contenders else None
    print(f"# {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; SmolLM2-135M fp32, greedy, "
          f"{args.max_new_tokens} new tokens, {args.num_speculative_tokens} n-gram draft tokens, draft model = first "
          f"{args.draft_layers} of {model.config.num_hidden_layers} layers ({args.draft_tokens} tokens)")
    speculative = {"plain": None, "ngram": "ngram", "ngram-always": "ngram", "draft": draft}
    managers = {}
    for name in args.contenders:
        managers[name] = init_continuous_batching(model, pool=BlockPool(16, num_blocks=2048),
                                                  speculative=speculative[name],
                                                  num_speculative_tokens=args.draft_tokens if name == "draft"
                                                  else args.num_speculative_tokens)
        managers[name].start()
        if name == "ngram-always":
            managers[name]._core.speculation.policy.choose = lambda options: len(options) - 1
    rows = []
    try:
        for c in args.concurrency:
            batch = prompts(tokenizer, c, offset=c)
            results = {}
            for name in args.contenders:  # warm-up: the policy measures this machine's step costs
                run(managers[name], prompts(tokenizer, c, offset=c + 7), args.max_new_tokens)
            for name in args.contenders:
                stats = managers[name]._core.speculation.stats
                before = (stats.steps, stats.speculative_steps, stats.accepted, stats.verified_requests)
                seconds, tokens = run(managers[name], batch, args.max_new_tokens)
                steps, spec_steps, accepted, verified = (stats.steps - before[0], stats.speculative_steps - before[1],
                                                         stats.accepted - before[2],
                                                         stats.verified_requests - before[3])
                results[name] = (seconds, tokens, steps, spec_steps, accepted, verified)
            plain = results.get("plain")
            for name, (seconds, tokens, steps, spec_steps, accepted, verified) in results.items():
                n = sum(len(t) for t in tokens)
                same = "-" if plain is None or name == "plain" else ("yes" if tokens == plain[1] else "NO")
                rows.append([c, name, n, f"{n / seconds:.1f}",
                             f"{(n / seconds) / (sum(len(t) for t in plain[1]) / plain[0]):.2f}x" if plain else "-",
                             f"{accepted / verified:.2f}" if verified else "-",
                             f"{spec_steps}/{steps}", same])
            print(format_table(["requests", "contender", "tokens", "tokens/s", "vs plain", "accepted/verify",
                                "spec steps", "same tokens"], rows[-len(results):]), flush=True)
    finally:
        for m in managers.values():
            m.stop()
    print(format_table(["requests", "contender", "tokens", "tokens/s", "vs plain", "accepted/verify", "spec steps",
                        "same tokens"], rows))


if __name__ == "__main__":
    main()
