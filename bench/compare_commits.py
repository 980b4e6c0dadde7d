"""Did a change move PagedCache's speed relative to DynamicCache? The same bench on two commits, alternated.

For each commit a worker process imports hf_paged from that commit's checkout (the old one in a temporary, detached
``git worktree``, removed afterwards; the new one by default this checkout, uncommitted edits included), loads the
embedded SmolLM2-135M-Instruct (fp32, CPU) once, and on request times greedy ``generate()`` with DynamicCache (model
not patched) and with PagedCache (torch backend, eager), alternated. Each round asks the old worker, then the new one
(reversed every other round), for one ratio: PagedCache tokens/s / DynamicCache tokens/s (each the faster of
``--reps`` runs). Printed: per round the two ratios, then the median of the rounds and the change in percent.
Every row generates exactly ``--new-tokens`` tokens (min_new_tokens), so both caches do the same work.

On a machine shared with other jobs wall-clock rates swing several-fold from run to run; by default the workers
run torch on one thread and time with the process's CPU time (``--clock cpu``), which other jobs disturb far less.
``--clock wall --threads 0`` times what a user sees (all cores).

Default old commit: the parent of the commit that added ``hf_paged/rows.py`` (the row-model refactor).

    python bench/compare_commits.py                       # 5 rounds, 4 prompts x 16 new tokens (~4 min)
    python bench/compare_commits.py --old 3f56f4a --new HEAD --rounds 3 --batch 4
"""

from __future__ import annotations

import argparse
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


# ---------------------------------------------------------------- worker (runs inside one commit's checkout)
def worker(root: str, model_dir: str, batch: int, new_tokens: int, reps: int, threads: int, clock: str) -> None:
    """Serve ratio requests on stdin/stdout (one JSON line each) for the hf_paged at ``root``."""
    sys.path.insert(0, root)
    import torch

    if threads:
        torch.set_num_threads(threads)
    now = time.process_time if clock == "cpu" else time.perf_counter
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    import hf_paged
    from hf_paged import PagedCache, compat, disable_paged_attention, enable_paged_attention
    from hf_paged.embedded import CHAT_PROMPTS

    assert Path(hf_paged.__file__).resolve().is_relative_to(Path(root).resolve()), hf_paged.__file__
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in CHAT_PROMPTS[:batch]]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    key = compat.GENERATE_CACHE_KWARG

    def run(paged: bool) -> tuple[float, torch.Tensor]:
        if paged:
            enable_paged_attention(model, backend="torch")
            cache = PagedCache(model.config)
        else:
            disable_paged_attention(model)
            cache = DynamicCache()
        start = now()
        with torch.inference_mode():
            out = model.generate(**inputs, **{key: cache}, do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)
        return now() - start, out

    _, expected = run(False)  # warm-up, both paths
    _, got = run(True)
    print(json.dumps({"ready": True, "equal": bool(torch.equal(got, expected))}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        times = {False: [], True: []}
        for r in range(reps):
            for paged in ((False, True) if r % 2 == 0 else (True, False)):
                times[paged].append(run(paged)[0])
        tokens = batch * new_tokens
        dynamic, paged = tokens / min(times[False]), tokens / min(times[True])
        print(json.dumps({"dynamic_tps": dynamic, "paged_tps": paged, "ratio": paged / dynamic}), flush=True)


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
               "--threads", str(args.threads), "--clock", args.clock]
        env = dict(os.environ, PYTHONPATH=str(root))
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} worker exited (status {self.proc.wait()}): see its stderr above")
        return json.loads(line)

    def ratio(self) -> dict:
        self.proc.stdin.write("go\n")
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
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=2, help="runs per cache per round and commit (the fastest counts)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (0: torch's default)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="time generate() by process CPU time "
                   "(steadier on a shared machine) or wall clock")
    p.add_argument("--model-dir", help="a local model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.model_dir, args.batch, args.new_tokens, args.reps, args.threads, args.clock)
        return

    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from hf_paged import embedded
    from hf_paged.report import cpu_name

    args.model_dir = args.model_dir or str(embedded.local_model_dir())
    old = git("rev-parse", args.old) if args.old else default_old()
    new = args.new if args.new == "WORKTREE" else git("rev-parse", args.new)
    labels = {"old": old[:8], "new": "this checkout" if new == "WORKTREE" else new[:8]}
    print(f"machine: {cpu_name()} ({platform.machine()}), {os.cpu_count()} cores, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; {time.strftime('%Y-%m-%d')}")
    print(f"old: {old[:8]} {git('log', '-1', '--format=%s', old)[:70]}")
    print(f"new: {labels['new']}")
    print(f"workload: {args.batch} chat prompts x {args.new_tokens} new tokens, greedy, fp32, PagedCache (torch, "
          f"eager) vs DynamicCache; fastest of {args.reps} per round; {args.rounds} rounds alternated; "
          f"{args.clock} time, torch threads {args.threads or torch.get_num_threads()}\n")
    trees: list[Path] = []
    workers = {}
    start = time.perf_counter()
    try:
        workers = {"old": Worker("old", checkout(old, trees), args), "new": Worker("new", checkout(new, trees), args)}
        for name, w in workers.items():
            if not w.hello["equal"]:
                print(f"warning: {name}: PagedCache's tokens differ from DynamicCache's")
        ratios = {"old": [], "new": []}
        print(f"{'round':>5}  {'old ratio':>9}  {'new ratio':>9}  {'change':>7}  {'old tok/s (dyn, paged)':>23}  "
              f"{'new tok/s (dyn, paged)':>23}")
        for r in range(args.rounds):
            got = {}
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                got[name] = workers[name].ratio()
                ratios[name].append(got[name]["ratio"])
            o, n = got["old"], got["new"]
            tps = "  ".join(f"{g['dynamic_tps']:>11.1f} {g['paged_tps']:>11.1f}" for g in (o, n))
            print(f"{r + 1:>5}  {o['ratio']:>9.3f}  {n['ratio']:>9.3f}  {100 * (n['ratio'] / o['ratio'] - 1):>+6.1f}%  "
                  f"{tps}", flush=True)
        mo, mn = statistics.median(ratios["old"]), statistics.median(ratios["new"])
        change = 100 * (mn / mo - 1)
        print(f"{'median':>5}  {mo:>9.3f}  {mn:>9.3f}  {change:>+6.1f}%   "
              f"({'within' if abs(change) <= 5 else 'OUTSIDE'} +-5%; {time.perf_counter() - start:.0f} s)")
    finally:
        for w in workers.values():
            w.close()
        for path in trees:
            git("worktree", "remove", "--force", str(path))
            path.parent.rmdir()


if __name__ == "__main__":
    main()
