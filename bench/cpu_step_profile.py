"""Where does a CPU decode step's time go? The engine decoding 1, 8 and 32 rows of the embedded model (256-token
prompts), each layer kind timed by forward hooks (their own cost, ~1 us a hook, counts in "other"):

- linears: every ``nn.Linear`` (q/k/v/o, gate/up/down, the output head);
- attention: the attention modules less their linears (rope, the paged attention call, reshapes);
- norms: the RMSNorm modules; other: the rest of the forward (embedding, residual adds, hooks, the cache's per-layer
  plumbing);
- plan / schedule / sample / output: the engine's host stages (``EngineCore.times``);
- detokenize: the server's incremental detokenizer (``serve/detokenizer.py``) per step of rows, timed apart.

Each configuration (``--linears``: eager ``F.linear`` vs prepacked oneDNN weights vs int8) runs in one process,
alternated by rows; figures are medians over the decode-only steps.

    python bench/cpu_step_profile.py                       # bf16, eager and packed, rows 1 8 32
    python bench/cpu_step_profile.py --dtype float32 --linears eager
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the checkout, not bench/ (its kernels.py would shadow a package)

from hf_paged import embedded  # noqa: E402
from hf_paged.engine.cpu_linears import prepare_cpu_linears  # noqa: E402
from hf_paged.engine.factory import init_continuous_batching  # noqa: E402
from hf_paged.pool import BlockPool  # noqa: E402
from hf_paged.report import cpu_name, format_table  # noqa: E402
from hf_paged.serve.detokenizer import IncrementalDetokenizer  # noqa: E402

PARTS = ("linears", "attention", "norms", "other", "plan", "schedule", "sample", "output")


class Timers:
    """Seconds spent in each kind of module during the current forward (hooks; nested linears subtracted)."""

    def __init__(self, model: nn.Module):
        self.total = defaultdict(float)
        self._start = {}
        self.handles = []
        for name, module in model.named_modules():
            kind = ("linears" if isinstance(module, nn.Linear) else
                    "attention" if name.endswith("self_attn") else
                    "norms" if "norm" in type(module).__name__.lower() else None)
            if kind is not None:
                self.handles.append(module.register_forward_pre_hook(lambda m, a, kind=kind: self._pre(m, kind)))
                self.handles.append(module.register_forward_hook(lambda m, a, o, kind=kind: self._post(m, kind)))

    def _pre(self, module, kind):
        self._start[id(module)] = (time.perf_counter(), kind)

    def _post(self, module, kind):
        spent = time.perf_counter() - self._start.pop(id(module))[0]
        self.total[kind] += spent
        if kind != "attention" and any(k == "attention" for _, k in self._start.values()):
            self.total["attention"] -= spent  # a projection inside an attention module: not the attention's own

    def take(self) -> dict:
        out, self.total = dict(self.total), defaultdict(float)
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def profile(model, tokenizer, rows: int, prompt_tokens: int, steps: int, ops: int = 0) -> tuple[dict, list[int]]:
    """Median seconds per part over the decode-only steps of ``rows`` requests; and the first request's tokens."""
    base = tokenizer("The history of the paged cache: " * 64).input_ids[:prompt_tokens]
    prompts = [[(t + i) % 30000 + 100 if j == 0 else t for j, t in enumerate(base)] for i in range(rows)]
    pool = BlockPool(block_size=16, num_blocks=rows * ((prompt_tokens + steps + 40) // 16 + 2), prefix_caching=False)
    manager = init_continuous_batching(model, pool=pool, max_batch_tokens=512, cpu_linears="keep")
    core = manager._core
    timers = Timers(model)
    samples = []
    step = core.step

    def timed_step():
        before = {p: getattr(core.times, p) for p in ("plan", "schedule", "sample", "output", "forward")}
        timers.take()
        out = step()
        parts = timers.take()
        after = {p: getattr(core.times, p) for p in before}
        if core.last_batch_tokens == rows and len(core.scheduler.running) == rows:
            if ops and len(samples) == 2:  # one decode step under torch's profiler: its top ops by self time
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    step()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=ops), flush=True)
                timers.take()
            forward = after["forward"] - before["forward"]
            inner = {k: parts.get(k, 0.0) for k in ("linears", "attention", "norms")}
            row = {**inner, "other": forward - sum(inner.values()), "forward": forward}
            row.update({p: after[p] - before[p] for p in ("plan", "schedule", "sample")})
            samples.append(row)
        return out

    core.step = timed_step
    try:
        manager.start()
        # the first rows decode while the last prefill (512-token steps): long enough to decode all together after
        ids = manager.add_requests(prompts, max_new_tokens=steps + 4 + rows * prompt_tokens // 512, do_sample=False,
                                   ignore_eos=True)
        results = [manager.get_result(rid) for rid in ids]
    finally:
        manager.stop()
        timers.remove()
    if not samples:
        raise RuntimeError(f"no decode-only step of {rows} rows was seen: raise --steps.")
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    detok = IncrementalDetokenizer(tokenizer)
    tokens = list(results[0].generated_tokens)
    start = time.perf_counter()
    for t in tokens:
        detok.add([t])
    med["detokenize"] = (time.perf_counter() - start) / max(1, len(tokens)) * rows
    med["samples"] = len(samples)
    return med, tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--linears", default="eager,packed", help="comma-separated: eager, packed, int8")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=12, help="decode steps per configuration")
    p.add_argument("--ops", type=int, default=0, help="also print one decode step's top N ops (torch profiler)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"machine: {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype}; "
          "shared with other work: noisy", flush=True)
    model, tokenizer = embedded.load(dtype=dtype)
    table = []
    tokens = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        for linears in args.linears.split(","):
            prepare_cpu_linears(model, linears)
            med, toks = profile(model, tokenizer, rows, args.prompt_tokens, args.steps, args.ops)
            tokens[(rows, linears)] = toks
            fwd = med["forward"]
            step = fwd + med["plan"] + med["schedule"] + med["sample"]
            table.append([rows, linears, f"{step * 1e3:.1f}", f"{rows / step:.1f}"]
                         + [f"{med[k] * 1e3:.1f} ({med[k] / step:.0%})" for k in
                            ("linears", "attention", "norms", "other", "plan", "schedule", "sample")]
                         + [f"{med['detokenize'] * 1e3:.2f}", med["samples"]])
            print(format_table(["rows", "linears", "step ms", "tok/s", "linears", "attention", "norms", "other",
                                "plan", "schedule", "sample", "detok ms", "steps"], table[-1:]), flush=True)
    print(format_table(["rows", "linears", "step ms", "tok/s", "linears", "attention", "norms", "other", "plan",
                        "schedule", "sample", "detok ms", "steps"], table))
    for rows in [int(r) for r in args.rows.split(",")]:
        got = [tokens[(rows, lin)] for lin in args.linears.split(",")]
        print(f"rows {rows}: first request's greedy tokens equal across {args.linears}: "
              f"{all(g == got[0] for g in got)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
