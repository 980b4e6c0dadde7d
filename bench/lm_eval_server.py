"""lm-evaluation-harness against the server vs lm-eval's own `hf` model, on the embedded SmolLM2.

One question: does `lm_eval --model local-completions` against `python -m hf_paged serve` give the same results as
`lm_eval --model hf` on the same checkpoint, for a multiple-choice task (loglikelihood: echo + logprobs) and a
generation task (generate_until)? Both tasks are local YAMLs over small local JSONL files written here (no dataset
is downloaded). Prints accuracy per task and model, and the largest per-request loglikelihood difference.

lm-eval needs its own environment (it must not change the project's):

    python -m venv /tmp/evalvenv && /tmp/evalvenv/bin/pip install torch==2.13.0 lm-eval
    python bench/lm_eval_server.py --lm-eval /tmp/evalvenv/bin/lm_eval
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_paged import embedded  # noqa: E402

MC = [
    ("What is the capital of France?", ["Paris", "Rome", "Madrid", "Berlin"], 0),
    ("How many legs does a spider have?", ["Six", "Eight", "Ten", "Four"], 1),
    ("What color is the sky on a clear day?", ["Green", "Red", "Blue", "Black"], 2),
    ("Which animal barks?", ["Cat", "Cow", "Fish", "Dog"], 3),
    ("What is 2 + 2?", ["4", "5", "3", "22"], 0),
    ("Water freezes at what temperature in Celsius?", ["100", "0", "50", "-40"], 1),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth", "Jupiter"], 2),
    ("What do bees make?", ["Milk", "Silk", "Wool", "Honey"], 3),
    ("What is the opposite of hot?", ["Cold", "Warm", "Big", "Fast"], 0),
    ("How many days are in a week?", ["Five", "Seven", "Ten", "Twelve"], 1),
    ("Which is a fruit?", ["Carrot", "Potato", "Apple", "Onion"], 2),
    ("What is the largest ocean?", ["Arctic", "Indian", "Atlantic", "Pacific"], 3),
    ("What gas do plants absorb?", ["Carbon dioxide", "Helium", "Neon", "Argon"], 0),
    ("Which season is the coldest?", ["Summer", "Winter", "Spring", "Autumn"], 1),
    ("What is the chemical symbol for water?", ["CO2", "O2", "H2O", "NaCl"], 2),
    ("Who wrote Romeo and Juliet?", ["Dickens", "Tolstoy", "Twain", "Shakespeare"], 3),
]
GEN = [
    ("What is the capital of France?", "Paris"), ("What is the capital of Italy?", "Rome"),
    ("What is 3 + 4?", "7"), ("What color is grass?", "Green"), ("What is the capital of Japan?", "Tokyo"),
    ("How many legs does a cat have?", "4"), ("What is the capital of Spain?", "Madrid"),
    ("What is 10 - 3?", "7"),
]
MC_YAML = """task: hfp_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_YAML = """task: hfp_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "Q:"]
  max_gen_toks: 12
  do_sample: false
filter_list:
  - name: last_word
    filter:
      - function: regex
        regex_pattern: '(\\w+)\\W*$'
      - function: take_first
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: [" "]
"""


def write_tasks(root: Path) -> Path:
    with open(root / "mc.jsonl", "w") as f:
        for q, choices, answer in MC:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    with open(root / "gen.jsonl", "w") as f:
        for q, a in GEN:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "mc.yaml").write_text(MC_YAML.format(dir=root))
    (tasks / "gen.yaml").write_text(GEN_YAML.format(dir=root))
    return tasks


def lm_eval(exe: str, model: str, model_args: str, tasks: Path, out: Path, log: Path) -> tuple[dict, float]:
    cmd = [exe, "--model", model, "--model_args", model_args, "--tasks", "hfp_tiny_mc,hfp_tiny_gen",
           "--include_path", str(tasks), "--output_path", str(out), "--log_samples", "--batch_size", "1"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "2"}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"lm_eval --model {model} failed ({done.returncode}); see {log}:\n"
                         + "\n".join(log.read_text().splitlines()[-25:]))
    results = next(out.rglob("results_*.json"))
    return {"results": json.loads(results.read_text())["results"],
            "samples": list(out.rglob("samples_*.jsonl"))}, seconds


def loglikelihoods(sample_files) -> dict:
    out = {}
    for path in sample_files:
        if "mc" not in path.name:
            continue
        for line in path.read_text().splitlines():
            s = json.loads(line)
            for i, resp in enumerate(s["resps"]):
                out[(s["doc_id"], i)] = float(resp[0][0])
    return out


def generations(sample_files) -> dict:
    out = {}
    for path in sample_files:
        if "gen" in path.name:
            for line in path.read_text().splitlines():
                s = json.loads(line)
                out[s["doc_id"]] = s["resps"][0][0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-eval", default="/tmp/evalvenv/bin/lm_eval")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    model_dir = embedded.local_model_dir()
    port = args.port
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    root = Path(tempfile.mkdtemp(prefix="hfp_lmeval_"))
    tasks = write_tasks(root)
    server = subprocess.Popen([sys.executable, "-m", "hf_paged", "serve", "--port", str(port),
                               "--served-model-name", "smollm2", "--log-level", "warning"],
                              stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        served, t_served = lm_eval(args.lm_eval, "local-completions",
                                   f"model=smollm2,base_url=http://127.0.0.1:{port}/v1/completions,"
                                   f"num_concurrent=4,tokenizer_backend=huggingface,tokenizer={model_dir},"
                                   "tokenized_requests=True,max_retries=1",
                                   tasks, root / "out_served", root / "served.log")
    finally:
        server.terminate()
        server.wait(60)
    hf, t_hf = lm_eval(args.lm_eval, "hf", f"pretrained={model_dir},dtype=float32", tasks, root / "out_hf",
                       root / "hf.log")
    print(f"# embedded SmolLM2, {len(MC)} multiple-choice + {len(GEN)} generation items, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs; files in {root}")
    print(f"{'task':14} {'metric':12} {'server':>8} {'hf':>8}")
    for task in ("hfp_tiny_mc", "hfp_tiny_gen"):
        for key, value in hf["results"][task].items():
            if "," in key and "_stderr," not in key and isinstance(value, (int, float)):
                print(f"{task:14} {key.split(',')[0]:12} {served['results'][task][key]:8.3f} {value:8.3f}")
    a, b = loglikelihoods(served["samples"]), loglikelihoods(hf["samples"])
    common = sorted(a.keys() & b.keys())
    if common:
        worst = max(abs(a[k] - b[k]) for k in common)
        print(f"loglikelihoods compared: {len(common)}, largest |server - hf|: {worst:.2e}")
    ga, gb = generations(served["samples"]), generations(hf["samples"])
    same = sum(ga[k] == gb.get(k) for k in ga)
    print(f"generations identical to hf's: {same}/{len(ga)}")
    print(f"wall time: server {t_served:.0f} s, hf {t_hf:.0f} s")


if __name__ == "__main__":
    main()
