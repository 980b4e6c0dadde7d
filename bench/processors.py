"""What do per-request logits processors cost the engine? Steps/s and the sampler's time per step, for requests without
processors (before vs after the processor stage) and for a mix of requests with them.

Two checkouts are compared: ``--old`` (default ``/work/main``, the engine before ``processors.py``) and this one. Each
round starts one worker process per checkout (the order flips every round); a worker imports hf_paged from its
checkout, builds the same random-weight Llama (2 layers, hidden 64, vocab ``--vocab``: a tiny forward, so the host
work of sampling weighs as much as it can), and times, alternating:

- ``engine``: ``--requests`` prompts of 32 tokens through one engine, ``--new-tokens`` tokens each (``ignore_eos``),
  per workload: steps/s on the process's CPU time (the engine thread included; other jobs on a shared machine
  disturb it far less than wall time) and wall time;
- ``sampler``: ``Sampler()`` alone on ``[--requests, vocab]`` logits with histories of 256 ids: microseconds per call.

Workloads: ``plain`` (greedy, no processors), ``sampled`` (top-k 50, top-p 0.9, seeded), and on the new checkout
``mix`` (greedy, a quarter each: no processors; repetition penalty 1.2 + a 16-token logit bias; no-repeat-3-gram + 4
bad words; 8 suppressed tokens + begin-suppression + min length) and ``mix+own`` (the mix, an eighth of it with a custom
``logits_processor`` and a custom ``stopping_criteria`` each). Printed: the best of the rounds for each, and the
ratios new / old.

    python bench/processors.py                       # 3 rounds, 32 requests x 64 tokens (~3 min on 2 CPU cores)
    python bench/processors.py --rounds 5 --requests 64 --old /path/to/other/checkout
    python bench/processors.py --sampler-only --rounds 8   # the sampler's time alone (~2 min)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
PROMPT = 32


def _model(vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=0, eos_token_id=1)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def _settings(workload: str, i: int, vocab: int) -> dict:
    if workload == "plain":
        return {}
    if workload == "sampled":
        return dict(do_sample=True, top_k=50, top_p=0.9, seed=i)
    kind = i % 4
    out = {}
    if kind == 1:
        out = dict(repetition_penalty=1.2, sequence_bias=[[[t], 0.5] for t in range(100, 116)])
    elif kind == 2:
        out = dict(no_repeat_ngram_size=3, bad_words_ids=[[5], [6, 7], [8, 9, 10], [11]])
    elif kind == 3:
        out = dict(suppress_tokens=list(range(20, 28)), begin_suppress_tokens=[30, 31], min_length=PROMPT + 8,
                   eos_token_id=1)
    if workload == "mix+own" and i % 8 == 0:
        out["logits_processor"] = [lambda ids, scores: scores]
        out["stopping_criteria"] = [lambda ids, scores: False]
    return out


def _engine(model, workload: str, args) -> dict:
    import hf_paged
    from hf_paged import BlockPool

    rng = __import__("random").Random(1)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(PROMPT)] for _ in range(args.requests)]
    blocks = args.requests * ((PROMPT + args.new_tokens) // 16 + 2)
    manager = hf_paged.init_continuous_batching(model, pool=BlockPool(block_size=16, num_blocks=blocks),
                                                max_batch_tokens=512)
    ids = [manager.add_request(p, max_new_tokens=args.new_tokens, ignore_eos=True,
                               **_settings(workload, i, args.vocab)) for i, p in enumerate(prompts)]
    cpu, wall = time.process_time(), time.perf_counter()
    with manager:
        outs = [manager.get_result(rid, timeout=600) for rid in ids]
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        steps = manager.stats().steps
    assert all(o.error is None and len(o.generated_tokens) == args.new_tokens for o in outs), workload
    return {"steps": steps, "cpu_s": cpu, "wall_s": wall}


def _sampler(workload: str, args) -> float:
    import torch

    from hf_paged.engine.sampling import Sampler, SamplingParams

    n, g = args.requests, torch.Generator().manual_seed(0)
    logits = torch.randn(n, args.vocab, generator=g)  # [n, vocab]
    histories = [torch.randint(3, args.vocab, (256,), generator=g).tolist() for _ in range(n)]
    params = [SamplingParams.from_generation_config(None, **_settings(workload, i, args.vocab)) for i in range(n)]
    sampler = Sampler()
    generators = [sampler.new_generator(p) for p in params]
    extra = {"states": [sampler.join(p) for p in params]} if hasattr(sampler, "join") else {}
    calls, best = 30, float("inf")
    for _ in range(5):
        start = time.process_time()
        for _ in range(calls):
            sampler(logits, params, generators, histories, [5] * n, **extra)
        best = min(best, (time.process_time() - start) / calls)
    return best * 1e6


def worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    model = _model(args.vocab)
    out = {}
    for workload in args.workloads.split(","):
        engine = {"steps": 1, "cpu_s": 1.0, "wall_s": 1.0} if args.sampler_only else _engine(model, workload, args)
        out[workload] = {**engine, "sampler_us": _sampler(workload, args)}
    print("RESULT " + json.dumps(out), flush=True)


def run_worker(checkout: Path, workloads: list[str], args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--workloads", ",".join(workloads),
           "--requests", str(args.requests), "--new-tokens", str(args.new_tokens), "--vocab", str(args.vocab),
           *(["--sampler-only"] if args.sampler_only else [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not line:
        raise SystemExit(f"worker on {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="/work/main", help="the checkout to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--sampler-only", action="store_true", help="time the sampler alone (no engine runs)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", default="plain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    sides = {"old": (Path(args.old), ["plain", "sampled"]), "new": (HERE, ["plain", "sampled", "mix", "mix+own"])}
    best: dict[tuple[str, str], dict] = {}
    for r in range(args.rounds):
        for side in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
            checkout, workloads = sides[side]
            for workload, figures in run_worker(checkout, workloads, args).items():
                key = (side, workload)
                rate = figures["steps"] / figures["cpu_s"]
                if key not in best or rate > best[key]["rate"]:
                    best[key] = {**figures, "rate": rate, "wall_rate": figures["steps"] / figures["wall_s"]}
                best[key]["sampler_us"] = min(best[key]["sampler_us"], figures["sampler_us"])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch on 1 thread; "
          f"{args.requests} requests x {args.new_tokens} tokens, prompt {PROMPT}, vocab {args.vocab}; best of "
          f"{args.rounds} rounds")
    print(f"{'checkout':<8} {'workload':<9} {'steps':>6} {'steps/s cpu':>12} {'steps/s wall':>13} {'sampler us':>11}")
    for (side, workload), f in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{side:<8} {workload:<9} {f['steps']:>6} {f['rate']:>12.1f} {f['wall_rate']:>13.1f} "
              f"{f['sampler_us']:>11.0f}")
    for workload in ("plain", "sampled"):
        old, new = best[("old", workload)], best[("new", workload)]
        print(f"{workload}: new / old steps/s (cpu) {new['rate'] / old['rate']:.3f}, sampler time "
              f"{new['sampler_us'] / old['sampler_us']:.3f}")
    for workload in ("mix", "mix+own"):
        new, base = best[("new", workload)], best[("new", "plain")]
        print(f"{workload}: steps/s (cpu) vs plain on the new checkout {new['rate'] / base['rate']:.3f}, sampler "
              f"time {new['sampler_us'] / base['sampler_us']:.2f}x")


if __name__ == "__main__":
    main()
