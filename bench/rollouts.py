"""RL rollouts on CPU: a GRPO-shaped generation (P prompts x G samples each, N new tokens, temperature 1) as TRL's
trainers issue it (the G copies of a prompt side by side in one ``generate_batch`` call), on the same KV budget:

* ``hf_paged engine``: ``hf_paged.init_continuous_batching`` on a ``BlockPool(num_blocks=budget)``, prefix caching
  off and on (on: the G samples of a prompt share its blocks, computed once);
* ``transformers generate_batch``: transformers' own continuous batching (sdpa, page size 16, ``num_blocks`` =
  the budget, the same ``max_batch_tokens``; its block sharing on, as by default);
* ``padded generate()``: ``model.generate()`` with a ``DynamicCache`` in left-padded batches of as many sequences as
  the budget holds at their full length.

Every sequence generates exactly N tokens (EOS ignored), so the contenders do the same work. Reported: wall time,
generated tokens/s, peak KV bytes (blocks in use at the peak for the engine; the whole preallocated cache for
transformers'; the largest batch's DynamicCache for generate()), prompt tokens computed (positions through a
forward, padding included). Then, on the engine run with prefix caching: the cost of the weights check (a pass
over the model's tensors' version counters, once per admitted request) and ``manager.sleep()``'s bytes freed.

    python bench/rollouts.py                        # 8 prompts x 8 samples x 32 new tokens: ~10 minutes on the busy VM
    python bench/rollouts.py --prompts 32 --samples 8 --new-tokens 128   # the full GRPO shape (much longer on CPU)
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import ContinuousBatchingConfig, DynamicCache, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import transformers  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged import compat, embedded  # noqa: E402
from hf_paged.report import cpu_name, format_table, kv_bytes_per_token, mb  # noqa: E402

BLOCK = 16
BATCH_TOKENS = 512


def machine() -> str:
    return (f"{cpu_name()} ({platform.machine()}), {torch.get_num_threads()} torch threads; torch "
            f"{torch.__version__}, transformers {transformers.__version__}")


def grpo_prompts(tokenizer, prompts: int, samples: int) -> list[list[int]]:
    """``prompts`` chat prompts (a short task each), each repeated ``samples`` times side by side, as TRL sends."""
    out = []
    for i in range(prompts):
        question = embedded.CHAT_PROMPTS[i % len(embedded.CHAT_PROMPTS)]
        messages = [{"role": "system", "content": embedded.SYSTEM_PARAGRAPH[: 200 + 37 * (i % 5)]},
                    {"role": "user", "content": f"Task {i}: {question}"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        out += [list(ids)] * samples
    return out


class ColumnCounter:
    """Counts the input positions reaching the decoder (a forward pre-hook on ``model.model``)."""

    def __init__(self, model):
        self.columns = 0
        self.handle = model.model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        embeds = kwargs.get("inputs_embeds")
        self.columns += (ids if ids is not None else embeds).numel() // (1 if ids is not None else embeds.shape[-1])

    def close(self) -> int:
        self.handle.remove()
        return self.columns


def run_engine(model, inputs, new: int, budget: int, prefix_caching: bool, report: dict) -> dict:
    pool = hf_paged.BlockPool(BLOCK, num_blocks=budget, prefix_caching=prefix_caching)
    manager = hf_paged.init_continuous_batching(model, pool=pool, max_batch_tokens=BATCH_TOKENS)
    checks = []
    check = pool.check_weights

    def timed_check(m, rewalk=True):  # the weights check, timed (a walk per session, then once per step)
        t0 = time.perf_counter()
        out = check(m, rewalk)
        checks.append((rewalk, time.perf_counter() - t0))
        return out

    pool.check_weights = timed_check
    start = time.perf_counter()
    manager.start()
    ids = manager.add_requests(inputs, max_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                               ignore_eos=True, seed=0)
    outs = [manager.get_result(rid) for rid in ids]
    wall = time.perf_counter() - start
    manager.stop(keep_for_next_session=True)
    stats = manager.stats()
    kv = pool.memory_stats()
    generated = sum(len(o.generated_tokens) for o in outs)
    if prefix_caching:
        report["checks"] = checks
        report["check_tensors"] = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
        reserved = pool.bytes_reserved()
        report["sleep_freed"] = manager.sleep()
        report["reserved_before_sleep"] = reserved
        report["after_sleep"] = pool.bytes_reserved()
        report["wake"] = manager.wake()
    manager.destroy()
    return dict(wall=wall, generated=generated, peak_kv=kv.peak_blocks_in_use * kv.bytes_per_block,
                prompt_computed=stats.prompt_tokens_computed, prompt_tokens=stats.prompt_tokens)


def run_transformers(model, inputs, new: int, budget: int) -> dict:
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                              eos_token_id=-1, pad_token_id=model.generation_config.pad_token_id)
    cb = ContinuousBatchingConfig(page_size=BLOCK, num_blocks=budget, max_batch_tokens=BATCH_TOKENS,
                                  auto_switch_to_flash=False)
    counter = ColumnCounter(model)
    start = time.perf_counter()
    outs = model.generate_batch(inputs, generation_config=config, continuous_batching_config=cb, progress_bar=False)
    wall = time.perf_counter() - start
    columns = counter.close()
    generated = sum(len(o.generated_tokens) for o in outs.values())
    per_block = kv_bytes_per_token(model.config, model.dtype) * BLOCK
    # the decode forwards: each sequence's generated tokens but the last go through one
    return dict(wall=wall, generated=generated, peak_kv=budget * per_block,
                prompt_computed=columns - (generated - len(outs)), prompt_tokens=sum(map(len, inputs)))


def run_padded(model, tokenizer, inputs, new: int, budget: int) -> dict:
    longest = max(map(len, inputs))
    batch = max(1, min(len(inputs), budget * BLOCK // (longest + new)))
    per_token = kv_bytes_per_token(model.config, model.dtype)
    counter = ColumnCounter(model)
    generated, peak = 0, 0
    start = time.perf_counter()
    for i in range(0, len(inputs), batch):
        rows = inputs[i:i + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask,
                                 **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)},
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=tokenizer.pad_token_id)
        generated += (out.shape[1] - width) * len(rows)
        peak = max(peak, len(rows) * (width + new) * per_token)
    wall = time.perf_counter() - start
    columns = counter.close()
    return dict(wall=wall, generated=generated, peak_kv=peak, batch=batch,
                prompt_computed=columns - (new - 1) * len(inputs), prompt_tokens=sum(map(len, inputs)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--budget", type=float, default=0.5,
                        help="KV budget as a share of what every sequence needs at full length without sharing")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"machine: {machine()}", flush=True)
    print("loading the embedded SmolLM2-135M-Instruct (fp32), one copy per contender ...", flush=True)
    model, tokenizer = embedded.load()
    plain, _ = embedded.load()
    hf_paged.attach_paged_attention(model, backend="torch")
    inputs = grpo_prompts(tokenizer, args.prompts, args.samples)
    need = sum(-(-(len(p) + args.new_tokens) // BLOCK) for p in inputs)
    budget = max(int(need * args.budget), 1)
    lengths = sorted({len(p) for p in inputs})
    print(f"workload: {args.prompts} prompts x {args.samples} samples = {len(inputs)} sequences, prompts of "
          f"{lengths[0]}-{lengths[-1]} tokens, {args.new_tokens} new tokens each, temperature 1; KV budget {budget} "
          f"blocks of {BLOCK} ({args.budget:.0%} of the {need} all sequences need unshared); max_batch_tokens "
          f"{BATCH_TOKENS}", flush=True)

    report: dict = {}
    results = {}
    for name, run in [
        ("hf_paged engine, prefix caching on", lambda: run_engine(model, inputs, args.new_tokens, budget, True,
                                                                  report)),
        ("transformers generate_batch", lambda: run_transformers(plain, inputs, args.new_tokens, budget)),
        ("hf_paged engine, prefix caching off", lambda: run_engine(model, inputs, args.new_tokens, budget, False,
                                                                   report)),
        ("padded generate() + DynamicCache", lambda: run_padded(plain, tokenizer, inputs, args.new_tokens, budget)),
    ]:
        print(f"running {name} ...", flush=True)
        results[name] = run()
        r = results[name]
        print(f"  {r['wall']:.1f} s, {r['generated'] / r['wall']:.1f} tokens/s", flush=True)

    base = results["transformers generate_batch"]
    padded = results["padded generate() + DynamicCache"]
    rows = []
    for name, r in results.items():
        tps = r["generated"] / r["wall"]
        rows.append([name, f"{r['wall']:.1f}", f"{tps:.1f}", f"{tps / (base['generated'] / base['wall']):.2f}x",
                     f"{tps / (padded['generated'] / padded['wall']):.2f}x", mb(r["peak_kv"]),
                     f"{r['prompt_computed']:,} / {r['prompt_tokens']:,}"])
    print()
    print(format_table(["contender", "wall s", "tokens/s", "vs generate_batch", "vs padded generate()", "peak KV",
                        "prompt tokens computed / given"], rows))
    print(f"(padded generate() ran batches of {padded['batch']})")
    checks = report["checks"]
    walks = sorted(dt for rewalk, dt in checks if rewalk)
    looks = sorted(dt for rewalk, dt in checks if not rewalk)
    total = sum(dt for _, dt in checks)
    print(f"\nweights check over {report['check_tensors']} tensors: {len(walks)} with a walk of the modules (per "
          f"call / session) median {1e6 * walks[len(walks) // 2]:.0f} us; {len(looks)} per step (the last walk's "
          f"tensors) median {1e6 * looks[len(looks) // 2] if looks else 0:.0f} us; {total * 1e3:.1f} ms in all = "
          f"{total / results['hf_paged engine, prefix caching on']['wall']:.3%} of the engine's wall time")
    print(f"sleep(): freed {mb(report['sleep_freed'])} of K/V tensors ({mb(report['reserved_before_sleep'])} "
          f"reserved before, {mb(report['after_sleep'])} after); wake() took {mb(report['wake'])} again")


if __name__ == "__main__":
    main()
