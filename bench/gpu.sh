#!/usr/bin/env bash
# hf_paged on the GPU machine, one command, nothing downloaded (at most ~7.5 minutes, BUDGET; every stage is capped
# and guarded, so one failing stage does not stop the others), in this order:
#   wheels      (not DRY) when .whl/ holds wheels (e.g. a newer transformers than the machine's), installs them with
#                  pip --no-index --no-deps into /tmp/site (SITE), put on PYTHONPATH after the repo root
#   env         versions, GPU, nvidia-smi
#   kernel-tests   tests/test_kernels.py on the GPU (not the interpreter)
#   host        bench/paged_kernels.py --host: host us per paged_attention (decode, prefill) and write_kv call, launcher
#                  alone, eager model path and torch.ops.hf_paged.* op (median of 10k calls, minus an empty op of the
#                  same schema); DRY: kernels recorded instead of launched (TRITON_INTERPRET unset for this stage)
#   kernels-8b  bench/paged_kernels.py at Llama-3.1-8B's shape (32 q / 8 kv heads, d 128, bf16, block 16): the decode table
#                  (batch x context: us, GB/s, % of peak, x SDPA on a contiguous cache), prefill (batch 1 and 8, no
#                  history, vs SDPA is_causal), extend (512 over 2048, vs SDPA with a lower-right causal mask) and a
#                  mixed step (a 512-token chunk + 32 decode rows in one launch vs two launches)
#   e2e-*       generate() on random-weight bf16 models of real shapes built on the GPU (Llama-3.2-1B; MODELS="1b 8b"
#                  adds Llama-3.1-8B): DynamicCache, PagedCache eager (the eager ratio), StaticCache + compile, PagedCache
#                  compiled; tokens/s, KV bytes, peak memory, tokens equal to DynamicCache's
#   calls-*     (CALLS=1 only) bench/gpu_calls.py auto / explicit: compiled generate() call after call on one pool,
#                  transformers' default compile config vs an explicit CompileConfig(mode="reduce-overhead")
#   engine-1b   bench/gpu_engine.py: the continuous-batching engine (decode steps from CUDA graphs, and with
#                  cuda_graphs=False) vs transformers' generate_batch manager (its defaults) on 256 requests of
#                  bench/serve.py's mix at Llama-3.2-1B's shape: tokens/s, TTFT, graphs captured / replayed
#                  (engine.jsonl); DRY: tiny shapes, 8 requests, graphs emulated on CPU
#   engine-tp   bench/tp_engine.py: the engine under torchrun over N = all visible GPUs (tp_plan="auto", rank 0
#                  driving) vs one process, Llama-3.2-1B's shape, 64 requests: tokens/s, ratio to N = 1, KV bytes per
#                  block, requests with N = 1's tokens (engine-tp.jsonl); skipped below 2 GPUs; DRY: 2 gloo ranks, tiny
#   kernels-1b  bench/paged_kernels.py at Llama-3.2-1B's shape (d 64)
#   mla         bench/mla.py --kernel: one layer's MLA decode attention at DeepSeek-V3's shape (128 heads, rank 512,
#                  rope 64, bf16) over batch 1/32 x context 1k/8k: the Triton MLA kernel and the absorbed torch path
#                  on the paged latent vs transformers' expand-then-SDPA (us, GB/s, ratio; fails if Triton differs
#                  from torch by more than 2% of the largest output) (mla.json); DRY: tiny shapes, interpreter
#   triton-e2e  tests/test_triton_e2e.py (tiny models through the Triton backend) and the engine's Triton test, eager
#                  and with its decode steps replayed from CUDA graphs (emulated in DRY): tokens equal generate() alone
#
#   bash bench/gpu.sh                  # on the GPU machine: python3 with torch (CUDA), triton, transformers
#   DRY=1 bash bench/gpu.sh            # the same stages on CPU, Triton interpreter, tiny shapes (~3-5 minutes)
#   OUT=/tmp/gpu bash bench/gpu.sh     # where results go (default bench/out/gpu, or bench/out/dry)
#
# Results in $OUT: summary.txt (stage, exit code, seconds), results.md (the tables), env.txt, nvidia-smi.txt,
# e2e.jsonl (one JSON object per generate() run), host.json, kernels-8b.json, kernels-1b.json, one .log per stage.
# Exit status 0 when every stage passed. Environment: PYTHON (python3; .venv/bin/python for DRY when present),
# BUDGET (seconds for everything: 450; DRY 360), BATCH / PROMPT / NEW_TOKENS (generate() shape: 8 / 512 / 128),
# KERNELS_ARGS (extra bench/paged_kernels.py arguments), TESTS_K (pytest -k for the kernel tests), MODELS (1b),
# COMPILE_BACKEND (inductor; DRY eager), SITE (where .whl/ is installed: /tmp/site), SKIP (stage names not to run),
# CALLS (1: add the calls-* stages).
# Each stage's cap is also cut so that triton-e2e, last, keeps its share of the budget (RESERVE).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
DRY=${DRY:-0}
if [ "$DRY" = 1 ]; then
    OUT=${OUT:-bench/out/dry}
    [ -x .venv/bin/python ] && PYTHON=${PYTHON:-.venv/bin/python}
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    BUDGET=${BUDGET:-360} BATCH=${BATCH:-2} PROMPT=${PROMPT:-12} NEW_TOKENS=${NEW_TOKENS:-4}
    MODELS=${MODELS:-tiny}
    COMPILE_BACKEND=${COMPILE_BACKEND:-eager}  # dynamo traces the compiled path; inductor on CPU takes minutes
    TESTS_K=${TESTS_K:-"fp32-d64-bs16-gqa4 or prefill_matches_float64 and fp32-d64-bs16-gqa2 or skips_negative"}
else
    OUT=${OUT:-bench/out/gpu}
    export TRITON_INTERPRET=0
    BUDGET=${BUDGET:-450} BATCH=${BATCH:-8} PROMPT=${PROMPT:-512} NEW_TOKENS=${NEW_TOKENS:-128}
    MODELS=${MODELS:-1b}
    COMPILE_BACKEND=${COMPILE_BACKEND:-inductor}
    TESTS_K=${TESTS_K:-}
fi
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT BATCH PROMPT NEW_TOKENS COMPILE_BACKEND
SUMMARY="$OUT/summary.txt"
printf '%-26s %4s %7s\n' stage rc seconds >"$SUMMARY"
: >"$OUT/e2e.jsonl"
: >"$OUT/engine.jsonl"
: >"$OUT/engine-tp.jsonl"
FAILED=()
E2E=$(mktemp /tmp/hf_paged_e2e.XXXXXX.py)
DRY_KERNELS=$(mktemp /tmp/hf_paged_dry_kernels.XXXXXX.py)
trap 'rm -f "$E2E" "$DRY_KERNELS"' EXIT

# cap DRY_SECONDS GPU_SECONDS: the stage cap for this mode.
cap() { if [ "$DRY" = 1 ]; then echo "$1"; else echo "$2"; fi; }
TRITON_E2E_CAP=$(cap 90 60)
RESERVE=$TRITON_E2E_CAP  # seconds of BUDGET kept for the last stage (triton-e2e) until it runs

# stage NAME CAP CMD...: CMD under a time limit of min(CAP, what is left of BUDGET less RESERVE), output to screen
# and $OUT/NAME.log; records exit code and seconds (and returns that code); skipped (rc 125) when under 10 s of the
# budget is left.
stage() {
    local name=$1 cap=$2 start=$SECONDS rc=0
    shift 2
    local left=$((BUDGET - SECONDS - RESERVE))
    [ "$cap" -gt "$left" ] && cap=$left
    if [[ " ${SKIP:-} " == *" $name "* ]]; then
        echo "== $name: skipped (SKIP)" | tee "$OUT/$name.log"
        return 0
    elif [ "$cap" -lt 10 ]; then
        rc=125
        echo "== $name: skipped, the ${BUDGET}s budget is spent" | tee "$OUT/$name.log"
    else
        echo "== $name (cap ${cap}s): $*" | tee "$OUT/$name.log"
        timeout --signal=INT --kill-after=15 "$cap" "$@" 2>&1 | tee -a "$OUT/$name.log"
        rc=${PIPESTATUS[0]}
    fi
    printf '%-26s %4d %7d\n' "$name" "$rc" $((SECONDS - start)) | tee -a "$SUMMARY"
    [ "$rc" -eq 0 ] || FAILED+=("$name")
    return "$rc"
}

# ------------------------------------------------------------------------------------ generate() on a random model
cat >"$E2E" <<'EOF'
"""One generate() run on a random-weight Llama of a real shape; appends one JSON object to $OUT/e2e.jsonl."""
import json, os, sys, time

import torch
import transformers
from torch._dynamo.utils import counters
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

from hf_paged import BlockPool, PagedCache, compat, disable_paged_attention, enable_paged_attention

SHAPES = {  # hidden, layers, q heads, kv heads, head_dim, intermediate, vocab
    "8b": (4096, 32, 32, 8, 128, 14336, 128256), "1b": (2048, 16, 32, 8, 64, 8192, 128256),
    "tiny": (64, 2, 4, 2, 16, 128, 256),
}
model_name, contender = sys.argv[1], sys.argv[2]
out = os.environ["OUT"]
batch, prompt, new = (int(os.environ[k]) for k in ("BATCH", "PROMPT", "NEW_TOKENS"))
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
hidden, layers, heads, kv_heads, head_dim, inter, vocab = SHAPES[model_name]
config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
                     max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=None)
torch.manual_seed(0)
t0 = time.perf_counter()
with torch.device(device):
    model = LlamaForCausalLM(config).to(dtype).eval()
build_s = time.perf_counter() - t0
input_ids = torch.randint(2, vocab, (batch, prompt), device=device)  # [batch, prompt]
inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
compiled = contender.endswith("compiled")
gen = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new)
if compiled and device.type == "cpu":  # the dry run: an explicit config, since transformers compiles only on CUDA
    cc = CompileConfig(fullgraph=False, backend=os.environ.get("COMPILE_BACKEND", "inductor"), mode=None)
    cc._compile_all_devices = True
    gen["compile_config"] = cc
elif not compiled:
    # A fixed-size PagedCache on CUDA compiles by itself, as StaticCache does: the eager contender opts out. The
    # compiled ones take transformers' own default (inductor, reduce-overhead: CUDA graphs). Measured on the H200: an
    # explicit CompileConfig(mode="reduce-overhead") made the paged steps slower call after call (9 -> 16 ms), which
    # transformers' default did not (3.0 ms); not understood yet.
    gen["disable_compile"] = True
kv_bytes = None
pool = BlockPool(block_size=16, num_blocks=batch * -(-(prompt + new) // 16) + batch)


def run(max_new):
    global kv_bytes
    kwargs = dict(gen, max_new_tokens=max_new, min_new_tokens=max_new)
    if contender.startswith("static"):
        kwargs["cache_implementation"] = "static"
    elif contender.startswith("paged"):  # one pool for both calls: its graphs, recorded once, replay for both
        cache = PagedCache(model.config, pool=pool)
        kwargs[compat.GENERATE_CACHE_KWARG] = cache
    with torch.inference_mode():
        result = model.generate(**inputs, **kwargs)
    if contender.startswith("paged"):
        kv_bytes = cache.memory_stats().bytes_reserved
    return result


if contender.startswith("paged"):
    enable_paged_attention(model)
if device.type == "cuda":
    torch.cuda.synchronize()
t0 = time.perf_counter()
run(new if compiled else 4)  # warm-up: compiles (Triton kernels, torch.compile) outside the timed run
warm_s = time.perf_counter() - t0
if device.type == "cuda":
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
t0 = time.perf_counter()
tokens = run(new)
if device.type == "cuda":
    torch.cuda.synchronize()
seconds = time.perf_counter() - t0
new_tokens = tokens[:, prompt:].cpu()  # [batch, new]
if kv_bytes is None:  # DynamicCache and StaticCache hold every row's K and V for prompt + new positions
    kv_bytes = 2 * layers * batch * (prompt + new) * kv_heads * head_dim * torch.finfo(dtype).bits // 8
reference = os.path.join(out, f"e2e-{model_name}-dynamic-tokens.pt")
if contender == "dynamic":
    torch.save(new_tokens, reference)
equal = None
if os.path.exists(reference) and contender != "dynamic":
    ref = torch.load(reference)
    equal = dict(rows=int((ref == new_tokens).all(1).sum()), of=batch,
                 first_difference=int((ref != new_tokens).any(0).nonzero()[0]) if (ref != new_tokens).any() else None)
row = dict(model=model_name, contender=contender, device=torch.cuda.get_device_name() if device.type == "cuda"
           else "cpu", dtype=str(dtype), batch=batch, prompt=prompt, new_tokens=new, seconds=seconds,
           tokens_per_s=batch * new / seconds, ms_per_step=1000 * seconds / new, warmup_s=warm_s, build_s=build_s,
           peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
           kv_reserved_bytes=kv_bytes, equal_to_dynamic=equal, torch=torch.__version__,
           transformers=transformers.__version__, compiled_graphs=counters["stats"]["unique_graphs"],
           graph_breaks=sum(counters["graph_break"].values()),
           cudagraph_skips=counters["inductor"]["cudagraph_skips"])
print(json.dumps(row))
with open(os.path.join(out, "e2e.jsonl"), "a") as f:
    f.write(json.dumps(row) + "\n")
EOF

# ------------------------------------------------------------------------------------------------------ stages
# Wheels carried to the machine (it has no internet): installed into $SITE, which goes on PYTHONPATH after the repo
# root (our package still wins) and before the machine's own site-packages. Without pip, wheels are zip files.
SITE=${SITE:-/tmp/site}
WHEELS=(.whl/*.whl)
if [ "$DRY" != 1 ] && [ -e "${WHEELS[0]}" ]; then
    if "$PY" -m pip --version >/dev/null 2>&1; then
        stage wheels 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "${WHEELS[@]}"
    else
        mkdir -p "$SITE"
        stage wheels 90 bash -c 'py=$1 site=$2; shift 2; for w; do echo "extract $w"; "$py" -m zipfile -e "$w" "$site" || exit; done' \
            - "$PY" "$SITE" "${WHEELS[@]}"
    fi && export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"  # only when they installed: else the machine's own
fi

stage env 60 "$PY" - <<'EOF'
import os, platform, sys
import torch, transformers
lines = [f"python {platform.python_version()} at {sys.executable}",
         f"torch {torch.__version__} (CUDA {torch.version.cuda})",
         f"transformers {transformers.__version__} at {os.path.dirname(transformers.__file__)}",
         f"cuda available: {torch.cuda.is_available()}"]
try:
    import triton
    lines.append(f"triton {triton.__version__}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}")
except ImportError:
    lines.append("triton: not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    lines.append(f"GPU {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, "
                 f"sm_{p.major}{p.minor}")
elif os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("no CUDA device visible to torch: run DRY=1 bash bench/gpu.sh on a CPU machine.")
from hf_paged.ops import triton_kernels
lines.append(f"hf_paged Triton kernels interpreted: {triton_kernels._INTERPRETED}")
print("\n".join(lines))
open(os.path.join(os.environ["OUT"], "env.txt"), "w").write("\n".join(lines) + "\n")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1

stage kernel-tests "$(cap 150 90)" "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py ${TESTS_K:+-k "$TESTS_K"}

if [ "$DRY" = 1 ]; then  # kernels recorded on CPU: the launcher's own cost, which needs the compiler, not the interpreter
    stage host 60 env -u TRITON_INTERPRET "$PY" bench/paged_kernels.py --host --calls 300 --host-batch 4 --host-context 64 \
        --host-prefill 16 --num-q-heads 4 --num-kv-heads 2 --head-dim 32 --json "$OUT/host.json"
else
    stage host 60 "$PY" bench/paged_kernels.py --host --json "$OUT/host.json"
fi

if [ "$DRY" = 1 ]; then  # bench/paged_kernels.py's own main needs CUDA: drive its functions on CPU with tiny shapes
    cat >"$DRY_KERNELS" <<'EOF'
import json, os, sys, time
sys.path.insert(0, "bench")
import torch
import paged_kernels as bk
from hf_paged.ops.triton_kernels import choose_num_kv_splits, paged_attention_triton
name, extra = sys.argv[1], sys.argv[2:]
args = bk.parse_args(["--batches", "2", "--contexts", "32", "--prefill-lens", "16", "--prefill-batches", "1",
                      "--extend", "4:12", "--mixed", "8,2,16", "--num-q-heads", "4", "--num-kv-heads", "2", *extra])
def do_bench(fn):  # one warm call, one timed (triton.testing.do_bench needs CUDA)
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3
cpu = torch.device("cpu")
result = dict(decode=bk.bench_decode(args, do_bench, choose_num_kv_splits, paged_attention_triton, cpu, 132),
              prefill=bk.bench_prefill(args, do_bench, paged_attention_triton, cpu),
              mixed=bk.bench_mixed(args, do_bench, paged_attention_triton, cpu))
print(json.dumps(result, indent=1))
with open(os.path.join(os.environ["OUT"], f"kernels-{name}.json"), "w") as f:
    json.dump(result, f)
EOF
    stage kernels-8b 60 "$PY" "$DRY_KERNELS" 8b --head-dim 32
else
    # shellcheck disable=SC2086  # KERNELS_ARGS is a word list on purpose
    stage kernels-8b 90 "$PY" bench/paged_kernels.py --json "$OUT/kernels-8b.json" ${KERNELS_ARGS:-}
fi

for model in $MODELS; do
    case "$DRY:$model" in  # caps: eager dynamic, eager paged, compiled static, compiled paged
        1:*) caps=(60 60 150 150) ;;
        0:1b) caps=(40 40 100 100) ;;
        *) caps=(30 30 90 90) ;;
    esac
    stage "e2e-$model-dynamic" "${caps[0]}" "$PY" "$E2E" "$model" dynamic
    stage "e2e-$model-paged" "${caps[1]}" "$PY" "$E2E" "$model" paged
    stage "e2e-$model-static-compiled" "${caps[2]}" "$PY" "$E2E" "$model" static-compiled
    stage "e2e-$model-paged-compiled" "${caps[3]}" "$PY" "$E2E" "$model" paged-compiled
done

if [ "${CALLS:-0}" = 1 ] && [ "$DRY" != 1 ]; then  # opt-in: the explicit reduce-overhead slowdown, call after call
    stage calls-auto 120 "$PY" bench/gpu_calls.py auto
    stage calls-explicit 120 "$PY" bench/gpu_calls.py explicit
fi

stage engine-1b "$(cap 120 150)" "$PY" bench/gpu_engine.py

# the engine over N = all visible GPUs (tensor parallel under torchrun) vs N = 1; skipped (rc 0) below 2 GPUs.
# DRY: 2 gloo ranks on CPU, tiny shape (the control path runs; its tokens/s say nothing about GPUs)
if [ "$DRY" = 1 ]; then
    stage engine-tp "$(cap 90 150)" "$PY" bench/tp_engine.py --ranks 2 --shape tiny --requests 8 --prompt 16 \
        --new-tokens 8 --batch-tokens 128 --blocks 128 --json "$OUT/engine-tp.jsonl"
else
    stage engine-tp "$(cap 90 150)" "$PY" bench/tp_engine.py --json "$OUT/engine-tp.jsonl"
fi

if [ "$DRY" != 1 ]; then  # (DRY: the kernels-8b stage already drove the same functions at tiny shapes)
    # shellcheck disable=SC2086
    stage kernels-1b 40 "$PY" bench/paged_kernels.py --head-dim 64 --batches 1,32,128 --contexts 1024,8192 \
        --prefill-lens 2048 --prefill-batches 8 --mixed "" --json "$OUT/kernels-1b.json" ${KERNELS_ARGS:-}
fi

if [ "$DRY" = 1 ]; then
    stage mla 60 "$PY" bench/mla.py --kernel --heads 4 --rank 32 --rope 16 --nope 16 --v 16 --batches 2 \
        --kernel-contexts 32 --json "$OUT/mla.json"
else
    stage mla 60 "$PY" bench/mla.py --kernel --json "$OUT/mla.json"
fi

RESERVE=0
# shellcheck disable=SC2086
stage triton-e2e "$TRITON_E2E_CAP" "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_triton_e2e.py \
    tests/test_engine_models.py::test_triton_backend ${DRY_E2E_K:+-k "$DRY_E2E_K"}

# ------------------------------------------------------------------------------------------------------ results
"$PY" - <<'EOF' | tee "$OUT/results.md"
import json, os
out = os.environ["OUT"]
def table(title, columns):
    print(f"\n### {title}\n\n| " + " | ".join(columns) + " |\n|" + "|".join("---" for _ in columns) + "|")


def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None


if os.path.exists(os.path.join(out, "env.txt")):
    print(open(os.path.join(out, "env.txt")).read().strip())
host = load("host.json")
if host:
    m = host["machine"]
    table(f"Host us per call ({m['device']}; {m['dtype']}, {m['num_q_heads']} q / {m['num_kv_heads']} kv heads, "
          f"d {m['head_dim']}, context {m['context']}; median of {m['calls']} calls)", ["call", "us", "minus empty op"])
    for r in host["host"]:
        minus = f"{r['minus_empty_op']:.1f}" if "minus_empty_op" in r else ""
        print(f"| {r['call'].strip()} | {r['us']:.1f} | {minus} |")
for name in ("8b", "1b"):
    data = load(f"kernels-{name}.json")
    if data is None:
        continue
    table(f"Decode kernel, {name} shape", ["batch", "context", "splits", "paged us", "GB/s", "% peak", "SDPA us",
                                          "paged/SDPA"])
    for r in data.get("decode", []):
        print(f"| {r['batch']} | {r['context']} | {r['splits']} | {r['paged_us']:.1f} | {r['paged_gbps']:.0f} | "
              f"{r['paged_pct_peak']:.1f} | {r['sdpa_us']:.1f} | {r['paged_over_sdpa']:.2f} |")
    table(f"Prefill / extend kernel, {name} shape", ["kind", "batch", "new", "history", "paged us", "TFLOP/s",
                                                    "SDPA us", "paged/SDPA"])
    for r in data.get("prefill", []):
        print(f"| {r.get('kind', 'prefill')} | {r['batch']} | {r.get('new', r['length'])} | {r.get('history', 0)} | "
              f"{r['paged_us']:.1f} | {r['paged_tflops']:.1f} | {r['sdpa_us']:.1f} | {r['paged_over_sdpa']:.2f} |")
    if data.get("mixed"):
        table(f"Mixed step, {name} shape", ["chunk", "decode rows", "context", "one launch us", "two launches us",
                                            "one / two"])
        for r in data["mixed"]:
            print(f"| {r['chunk']} | {r['decodes']} | {r['context']} | {r['mixed_us']:.1f} | {r['separate_us']:.1f} | "
                  f"{r['mixed_over_separate']:.2f} |")
mla = load("mla.json")
if mla:
    sh = mla["shape"]
    table(f"MLA decode attention, one layer ({sh['heads']} heads, rank {sh['rank']}, rope {sh['rope']})",
          ["batch", "context", "Triton us", "torch us", "expanded + SDPA us", "Triton GB/s", "expanded / Triton",
           "Triton vs torch (rel.)"])
    for r in mla["rows"]:
        print(f"| {r['batch']} | {r['context']} | {r['triton_us']:.1f} | {r['torch_us']:.1f} | "
              f"{r['expanded_us']:.1f} | {r['triton_gbps']:.0f} | {r['expanded_over_triton']:.1f} | "
              f"{r['triton_vs_torch_rel']:.1e} |")
rows = [json.loads(l) for l in open(os.path.join(out, "e2e.jsonl")) if l.strip()]
if rows:
    reference = {r["model"]: r["tokens_per_s"] for r in rows if r["contender"] == "dynamic"}
    table("generate()", ["model", "cache", "batch x prompt + new", "tokens/s", "x DynamicCache", "ms/step",
                         "warm-up s", "KV MiB", "peak GiB", "rows equal to Dynamic", "graphs / CUDA-graph skips"])
    for r in rows:
        eq = r["equal_to_dynamic"]
        eq = "reference" if r["contender"] == "dynamic" else ("-" if eq is None else f"{eq['rows']}/{eq['of']}")
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        ratio = f"{r['tokens_per_s'] / reference[r['model']]:.2f}" if r["model"] in reference else "-"
        print(f"| {r['model']} | {r['contender']} | {r['batch']} x {r['prompt']} + {r['new_tokens']} | "
              f"{r['tokens_per_s']:.0f} | {ratio} | {r['ms_per_step']:.1f} | {r['warmup_s']:.1f} | "
              f"{r['kv_reserved_bytes'] / 2**20:.2f} | {peak} | {eq} | "
              f"{r.get('compiled_graphs', '-')} / {r.get('cudagraph_skips', '-')} |")
EOF

echo
cat "$SUMMARY"
if [ "${#FAILED[@]}" -gt 0 ]; then
    echo "FAILED: ${FAILED[*]} (logs in $OUT)"
    exit 1
fi
echo "all stages passed in ${SECONDS}s; results in $OUT"
