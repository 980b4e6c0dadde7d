"""Did a change move hf_paged's headline figures? The same three benches on two commits, alternated.

The three figures, each a ratio of tokens/s measured in one process, contender over baseline:

- ``eager``: greedy ``generate()`` with PagedCache (torch backend, eager) / with DynamicCache;
- ``compiled``: ``generate()`` compiled (``CompileConfig``, on CPU too) with a fixed-size PagedCache pool / with
  StaticCache compiled;
- ``engine``: ``hf_paged.generate_batch`` / transformers' own ``generate_batch`` (page 16, ``num_blocks`` and
  ``max_batch_tokens`` set, sdpa), on ``--engine-requests`` chat prompts.

For each commit a worker process imports hf_paged from that commit's checkout (the old one in a temporary, detached
``git worktree``, removed afterwards; the new one by default this checkout, uncommitted edits included), loads the
embedded SmolLM2-135M-Instruct (fp32, CPU) once as two twins (one left as transformers has it, one put on the paged
path once, so compiled graphs are not invalidated by switching attention back and forth), runs every contender once
untimed (compiles, first-call costs), then on request times one figure: baseline and contender alternated ``--reps``
times, the fastest of each counting. Each round asks the old worker, then the new one (reversed every other round),
for every figure. Printed: per round and figure the two ratios, then per figure the median of the rounds and the
change in percent. Every row generates exactly ``--new-tokens`` tokens (min_new_tokens), so both sides do the same
work. A figure a commit cannot run (older API) is reported as failed for that commit and skipped.

On a machine shared with other jobs wall-clock rates swing several-fold from run to run; by default the workers
run torch on one thread and time with the process's CPU time (``--clock cpu``), which other jobs disturb far less
(the engines' threads are counted: CPU time is the process's). ``--clock wall --threads 0`` times what a user sees.

Default old commit: the parent of the commit that added ``hf_paged/rows.py`` (the row-model refactor).

    python bench/compare_commits.py                                  # all three figures, 3 rounds (~12 min)
    python bench/compare_commits.py --old ac86814 --figures eager,compiled --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = {"eager": ("PagedCache eager", "DynamicCache"),
           "compiled": ("PagedCache compiled", "StaticCache compiled"),
           "engine": ("hf_paged generate_batch", "transformers generate_batch")}


# ---------------------------------------------------------------- worker (runs inside one commit's checkout)
def worker(root: str, args) -> None:
    """Serve figure requests on stdin/stdout (one JSON line each) for the hf_paged at ``root``."""
    sys.path.insert(0, root)
    # An editable install maps hf_paged.patches to its own checkout's patches/: drop its finder, so the commit's own
    # patches/ is imported (as hf_paged/patches, or found beside the package by older commits).
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    now = time.process_time if args.clock == "cpu" else time.perf_counter
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig, StaticCache

    import hf_paged
    from hf_paged import BlockPool, PagedCache, compat, enable_paged_attention
    from hf_paged.embedded import CHAT_PROMPTS

    assert Path(hf_paged.__file__).resolve().is_relative_to(Path(root).resolve()), hf_paged.__file__
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32,
                                                attn_implementation="sdpa").eval()
    paged = enable_paged_attention(copy.deepcopy(base), backend="torch")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in CHAT_PROMPTS[:args.batch]]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    requests = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                              add_generation_prompt=True, return_dict=False)
                for p in (CHAT_PROMPTS * 4)[:args.engine_requests]]
    key, new = compat.GENERATE_CACHE_KWARG, args.new_tokens
    max_len = inputs["input_ids"].shape[1] + new
    blocks = args.batch * -(-max_len // 16) + 8
    compiled = transformers_compile_config()
    greedy = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=tokenizer.pad_token_id)

    def generate(model, cache, **extra):
        with torch.inference_mode():
            return model.generate(**inputs, **{key: cache}, **greedy, **extra)

    engine_config = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id)  # the same greedy tokens on both sides

    def engine_hf_paged():
        pool = BlockPool(block_size=16, num_blocks=512)
        out = hf_paged.generate_batch(paged, requests, engine_config, pool=pool, max_batch_tokens=256,
                                      progress_bar=False)
        return [list(o.generated_tokens) for o in out.values()]

    def engine_transformers():
        from transformers.generation import ContinuousBatchingConfig

        cb = ContinuousBatchingConfig(page_size=16, num_blocks=512, max_batch_tokens=256)
        out = base.generate_batch(requests, generation_config=engine_config, continuous_batching_config=cb,
                                  progress_bar=False)
        return [list(out[k].generated_tokens) for k in sorted(out, key=lambda k: int(k.rsplit("_", 1)[-1]))]

    contenders = {
        "PagedCache eager": lambda: generate(paged, PagedCache(paged.config), disable_compile=True),
        "DynamicCache": lambda: generate(base, DynamicCache(config=base.config)),
        "PagedCache compiled": lambda: generate(paged, PagedCache(paged.config, num_blocks=blocks),
                                                compile_config=compiled),
        "StaticCache compiled": lambda: generate(base, StaticCache(config=base.config, max_cache_len=max_len),
                                                 compile_config=compiled),
        "hf_paged generate_batch": engine_hf_paged,
        "transformers generate_batch": engine_transformers,
    }
    hello = {}
    for figure in args.figures.split(","):
        try:
            got, want = (contenders[name]() for name in FIGURES[figure])  # untimed: compiles, first-call costs
            hello[figure] = {"equal": bool(torch.equal(got, want)) if isinstance(got, torch.Tensor) else got == want}
        except Exception as err:  # an older commit may lack what a figure needs
            hello[figure] = {"error": f"{type(err).__name__}: {err}"[:300]}
    print(json.dumps({"ready": True, "figures": hello}), flush=True)
    for line in sys.stdin:
        figure = line.strip()
        if not figure:
            continue
        contender, baseline = FIGURES[figure]
        times, tokens = {contender: [], baseline: []}, {}
        for r in range(args.reps):
            for name in ((baseline, contender) if r % 2 == 0 else (contender, baseline)):
                start = now()
                out = contenders[name]()
                times[name].append(now() - start)
                tokens[name] = out.numel() - inputs["input_ids"].numel() if isinstance(out, torch.Tensor) \
                    else sum(map(len, out))
        fast, slow = tokens[contender] / min(times[contender]), tokens[baseline] / min(times[baseline])
        print(json.dumps({"contender_tps": fast, "baseline_tps": slow, "ratio": fast / slow}), flush=True)


def transformers_compile_config():
    from transformers.generation import CompileConfig

    config = CompileConfig(fullgraph=False)
    config._compile_all_devices = True  # transformers compiles on its own only on CUDA
    return config


# ---------------------------------------------------------------- driver
def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def default_old() -> str:
    added = git("log", "--diff-filter=A", "--format=%H", "--", "hf_paged/rows.py").split()
    if not added:
        raise SystemExit("no commit adds hf_paged/rows.py here: pass --old COMMIT")
    return git("rev-parse", added[-1] + "^")


class Worker:
    def __init__(self, name: str, root: Path, args):
        self.name = name
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(root), "--model-dir", args.model_dir,
               "--batch", str(args.batch), "--new-tokens", str(args.new_tokens), "--reps", str(args.reps),
               "--threads", str(args.threads), "--clock", args.clock, "--figures", args.figures,
               "--engine-requests", str(args.engine_requests)]
        env = dict(os.environ, PYTHONPATH=str(root))
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} worker exited (status {self.proc.wait()}): see its stderr above")
        return json.loads(line)

    def ratio(self, figure: str) -> dict:
        self.proc.stdin.write(figure + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def checkout(commit: str, keep: list) -> Path:
    """This checkout for the working tree, else a detached worktree of ``commit`` in a temporary directory."""
    if commit == "WORKTREE":
        return ROOT
    path = Path(tempfile.mkdtemp(prefix="hf_paged_" + commit[:8] + "_")) / "tree"
    git("worktree", "add", "--detach", str(path), commit)
    keep.append(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", help="old commit (default: the parent of the commit adding hf_paged/rows.py)")
    p.add_argument("--new", default="WORKTREE", help="new commit (default: this checkout as it is)")
    p.add_argument("--figures", default="eager,compiled,engine",
                   help=f"comma-separated figures to compare ({', '.join(FIGURES)})")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=2, help="runs per side per round, figure and commit (the fastest "
                   "counts)")
    p.add_argument("--batch", type=int, default=4, help="chat prompts per generate() (eager, compiled)")
    p.add_argument("--engine-requests", type=int, default=8, help="chat requests per engine run")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (0: torch's default)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="time by process CPU time (steadier on "
                   "a shared machine) or wall clock")
    p.add_argument("--model-dir", help="a local model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = set(args.figures.split(",")) - set(FIGURES)
    if unknown:
        p.error(f"unknown figure(s) {sorted(unknown)}; choose from {', '.join(FIGURES)}")
    if args.worker:
        worker(args.worker, args)
        return

    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from hf_paged import embedded
    from hf_paged.report import cpu_name

    args.model_dir = args.model_dir or str(embedded.local_model_dir())
    old = git("rev-parse", args.old) if args.old else default_old()
    new = args.new if args.new == "WORKTREE" else git("rev-parse", args.new)
    figures = args.figures.split(",")
    print(f"machine: {cpu_name()} ({platform.machine()}), {os.cpu_count()} cores, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; {time.strftime('%Y-%m-%d')}")
    print(f"old: {old[:8]} {git('log', '-1', '--format=%s', old)[:70]}")
    print(f"new: {'this checkout' if new == 'WORKTREE' else new[:8]}")
    print(f"workload: SmolLM2-135M fp32, greedy, {args.new_tokens} new tokens; eager/compiled: {args.batch} chat "
          f"prompts per generate(); engine: {args.engine_requests} chat requests; fastest of {args.reps} per round; "
          f"{args.rounds} rounds alternated; {args.clock} time, torch threads "
          f"{args.threads or torch.get_num_threads()}\n")
    trees: list[Path] = []
    workers = {}
    start = time.perf_counter()
    try:
        workers = {"old": Worker("old", checkout(old, trees), args), "new": Worker("new", checkout(new, trees), args)}
        for name, w in workers.items():
            for figure, hello in w.hello["figures"].items():
                if "error" in hello:
                    print(f"{name}: {figure} cannot run: {hello['error']}")
                elif not hello["equal"]:
                    print(f"warning: {name}: {figure}: {FIGURES[figure][0]}'s tokens differ from "
                          f"{FIGURES[figure][1]}'s")
        figures = [f for f in figures if all("error" not in w.hello["figures"][f] for w in workers.values())]
        ratios = {(f, name): [] for f in figures for name in workers}
        own = {(f, name): [] for f in figures for name in workers}  # the contender's own tokens/s (CPU time)
        print(f"{'round':>5}  {'figure':<9} {'old ratio':>9}  {'new ratio':>9}  {'change':>7}  "
              f"{'old tok/s (base, contender)':>27}  {'new tok/s (base, contender)':>27}")
        for r in range(args.rounds):
            for figure in figures:
                got = {}
                for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    got[name] = workers[name].ratio(figure)
                    ratios[figure, name].append(got[name]["ratio"])
                    own[figure, name].append(got[name]["contender_tps"])
                o, n = got["old"], got["new"]
                tps = "  ".join(f"{g['baseline_tps']:>13.1f} {g['contender_tps']:>13.1f}" for g in (o, n))
                print(f"{r + 1:>5}  {figure:<9} {o['ratio']:>9.3f}  {n['ratio']:>9.3f}  "
                      f"{100 * (n['ratio'] / o['ratio'] - 1):>+6.1f}%  {tps}", flush=True)
        print(f"\n{'figure':<9} {'ratio':<56} {'old':>7} {'new':>7} {'change':>8}   contender's own tok/s")
        for figure in figures:
            mo, mn = statistics.median(ratios[figure, "old"]), statistics.median(ratios[figure, "new"])
            to, tn = statistics.median(own[figure, "old"]), statistics.median(own[figure, "new"])
            change = 100 * (mn / mo - 1)
            print(f"{figure:<9} {FIGURES[figure][0] + ' / ' + FIGURES[figure][1]:<56} {mo:>7.3f} {mn:>7.3f} "
                  f"{change:>+7.1f}%  ({'within' if abs(change) <= 5 else 'OUTSIDE'} +-5%)  "
                  f"{to:.1f} -> {tn:.1f} ({100 * (tn / to - 1):+.1f}%)")
        print("A ratio moves with its baseline too; the contender's own tokens/s (process CPU time, one thread) "
              "says which side moved.")
        print(f"({time.perf_counter() - start:.0f} s)")
    finally:
        for w in workers.values():
            w.close()
        for path in trees:
            git("worktree", "remove", "--force", str(path))
            path.parent.rmdir()


if __name__ == "__main__":
    main()
