"""Which grammar library for structured output: xgrammar vs llguidance on the embedded SmolLM2 tokenizer.

One question: on this machine, what does each library cost to (a) get ready for a tokenizer, (b) compile a JSON
schema (and ``json_object``), (c) fill one request's token bitmask per generated token, walking a valid JSON
document token by token? Prints a table (medians over the schemas; times in ms).

    python bench/grammar_libraries.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

try:  # the library compared against hf_paged's xgrammar; not an hf_paged dependency
    import llguidance
    import llguidance.hf
    import llguidance.torch
except ImportError as e:
    raise SystemExit(f"bench/grammar_libraries.py compares xgrammar with llguidance, which is not installed ({e}): "
                     "pip install llguidance") from e
import xgrammar as xgr
from transformers import AutoTokenizer

from hf_paged import embedded
from hf_paged.engine.sampling import apply_bitmask
from hf_paged.engine.structured import GrammarCompiler, GrammarSpec

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "string"}, "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "status": {"enum": ["new", "paid", "shipped"]}, "note": {"type": ["string", "null"]}},
        "required": ["id", "items", "status", "note"], "additionalProperties": False},
    "weather_call": {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}, "required": ["name", "arguments"],
        "additionalProperties": False},
}
DOCS = {
    "person": {"name": "Ada Lovelace", "age": 36},
    "order": {"id": "A-17", "items": [{"sku": "pen", "qty": 3, "price": 1.5}, {"sku": "ink", "qty": 1,
                                                                                  "price": 7.25}],
              "status": "paid", "note": None},
    "weather_call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
}


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def bench_xgrammar(tok, vocab: int, rounds: int) -> dict:
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    setup = ms(t0)
    out = {"setup": setup, "compile": [], "json_object": [], "mask": []}
    for r in range(rounds):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        for name, schema in SCHEMAS.items():
            t0 = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema), strict_mode=True)
            out["compile"].append(ms(t0))
            if r == 0:
                matcher = xgr.GrammarMatcher(compiled)
                bitmask = xgr.allocate_token_bitmask(1, vocab)
                ids = tok(json.dumps(DOCS[name]), add_special_tokens=False)["input_ids"]
                for t in ids:
                    t0 = time.perf_counter()
                    matcher.fill_next_token_bitmask(bitmask)
                    out["mask"].append(ms(t0))
                    assert matcher.accept_token(t), (name, t)
        t0 = time.perf_counter()
        compiler.compile_builtin_json_grammar()
        out["json_object"].append(ms(t0))
    return out


def bench_llguidance(tok, vocab: int, rounds: int) -> dict:
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    setup = ms(t0)
    out = {"setup": setup, "compile": [], "json_object": [], "mask": []}
    for r in range(rounds):
        for name, schema in SCHEMAS.items():
            t0 = time.perf_counter()
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
            matcher = llguidance.LLMatcher(lltok, grammar)
            out["compile"].append(ms(t0))
            assert not matcher.is_error(), matcher.get_error()
            if r == 0:
                bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
                ids = tok(json.dumps(DOCS[name]), add_special_tokens=False)["input_ids"]
                for t in ids:
                    t0 = time.perf_counter()
                    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
                    out["mask"].append(ms(t0))
                    assert matcher.consume_token(t), (name, t, matcher.get_error())
        t0 = time.perf_counter()
        llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}))
        out["json_object"].append(ms(t0))
    return out


def engine_step_cost(tok, vocab: int, rows: int = 16, steps: int = 20) -> tuple[float, float]:
    """Median ms per engine step of the structured-output work for ``rows`` constrained requests (each matcher
    fills its bitmask row; the sampler masks the logits), and of a step's sampling of the same rows without it."""
    grammars = GrammarCompiler(tok, vocab_size=vocab)
    grammar = grammars.compile(GrammarSpec("json_schema", json.dumps(SCHEMAS["order"])))
    matchers = [grammar.matcher() for _ in range(rows)]
    ids = tok(json.dumps(DOCS["order"], separators=(",", ":")), add_special_tokens=False)["input_ids"]
    logits = torch.randn(rows, vocab)
    masked, plain = [], []
    for t in ids[:steps]:
        t0 = time.perf_counter()
        bitmask = torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)
        for j, m in enumerate(matchers):
            m.fill(bitmask, j)
        scores = apply_bitmask(logits, bitmask, list(range(rows)))
        scores.argmax(dim=-1)
        masked.append(ms(t0))
        t0 = time.perf_counter()
        logits.float().argmax(dim=-1)
        plain.append(ms(t0))
        for m in matchers:
            assert m.accept(t)
    return statistics.median(masked), statistics.median(plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(embedded.local_model_dir())
    vocab = len(tok)
    results = {"xgrammar 0.2.8": bench_xgrammar(tok, vocab, args.rounds),
               "llguidance 1.9.1": bench_llguidance(tok, vocab, args.rounds)}
    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, one thread; "
          f"vocabulary {vocab} (SmolLM2); {len(SCHEMAS)} schemas x {args.rounds} rounds")
    print(f"{'library':18} {'tokenizer setup':>16} {'schema compile':>15} {'json_object':>12} "
          f"{'mask/token med':>15} {'mask/token p90':>15}")
    for lib, r in results.items():
        masks = sorted(r["mask"])
        print(f"{lib:18} {r['setup']:14.1f}ms {statistics.median(r['compile']):13.2f}ms "
              f"{statistics.median(r['json_object']):10.2f}ms {statistics.median(masks):13.3f}ms "
              f"{masks[int(0.9 * (len(masks) - 1))]:13.3f}ms")
    masked, plain = engine_step_cost(tok, vocab)
    print(f"engine step, 16 constrained requests (xgrammar fill + hf_paged mask + argmax): {masked:.2f} ms; "
          f"argmax alone {plain:.2f} ms")


if __name__ == "__main__":
    main()
