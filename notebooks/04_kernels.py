# %% [markdown]
# # Kernels: paged attention against a float64 reference
#
# `hf_paged.ops.paged_attention` computes attention of packed queries over K/V read through block tables, with two
# backends: `"torch"` (gathers each sequence's blocks, then one SDPA call; the CPU path) and `"triton"` (the kernels).
# Here both are compared with a float64 computation written the slow, obvious way, on pools whose block tables are
# scrambled the way a busy pool's are. Shapes are tiny: on a CPU the Triton kernels run in Triton's interpreter.

# %%
import importlib.util
import os
import warnings

import torch

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: text bars

# Triton decides between its CPU interpreter and the compiler when it is first imported: choose now.
ON_GPU = torch.cuda.is_available()
if importlib.util.find_spec("triton") is not None:
    if ON_GPU:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = "1"

# %%
import itertools
import subprocess
import sys

from hf_paged import ops

DEVICE = "cuda" if ON_GPU else "cpu"
BACKENDS = ["torch"] + (["triton"] if ops.triton_available() else [])
print(f"device {DEVICE}; backends compared: {BACKENDS}"
      + ("" if ON_GPU or "triton" not in BACKENDS else " (Triton through its CPU interpreter)"))


# %% [markdown]
# ## A scrambled pool, and the reference
#
# The pool is `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V. `scrambled_case` gives each sequence
# its blocks at random physical places: its token at position `p` sits in slot `block_tables[s, p // block_size] *
# block_size + p % block_size`. Slots nobody owns hold NaN, so a kernel that reads one returns NaN. Table entries past
# a sequence's last block are -1 and must never be read, and so are the blocks that slid out of a sliding window.
#
# `attention_float64` is the reference: per sequence, per query, gather the sequence's keys and values through its
# block table into contiguous float64 rows, mask what the query may not see (later positions; with a sliding window
# `W`, all but the last `W` up to itself), and compute `softmax(q k^T * scale) v`. The last `q_len` positions of a
# sequence are its queries. Both come from the helpers the tests share (`tests/helpers/attention.py`).

# %%
sys.path.insert(0, os.path.abspath("../tests"))  # the tests' shared helpers
from helpers import attention_float64, scrambled_case

example = scrambled_case([5, 12], [1, 3], block_size=4, window=6, device=DEVICE)
print("block tables of two sequences (5 and 12 tokens, blocks of 4, window 6):", example["block_tables"].tolist())


# %% [markdown]
# ## Comparison
#
# Decode (one query per sequence), prefill and extend (several queries, some with cached history before them), and a
# sliding window. Error bounds, as in `tests/test_kernels.py`: the torch path within 8 ulps of the output's scale; the
# Triton kernels within 3 times the torch path's error, or one ulp at 1.0 when that is smaller.

# %%
CASES = {  # name: (seq_lens, q_lens, sliding_window)
    "decode": ([1, 9, 30], [1, 1, 1], None),
    "prefill + extend": ([5, 12, 30], [5, 3, 7], None),
    "decode, window 6": ([3, 17, 30], [1, 1, 1], 6),
    "extend, window 6": ([4, 20], [4, 9], 6),
}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])

rows = []
for (name, (seq_lens, q_lens, window)), dtype in itertools.product(CASES.items(), DTYPES):
    case = scrambled_case(seq_lens, q_lens, dtype=dtype, window=window, device=DEVICE)
    expected = attention_float64(**case)
    eps = torch.finfo(dtype).eps
    torch_err = None
    for backend in BACKENDS:
        out = ops.paged_attention(**case, backend=backend)  # [T, Hq, D]
        err = (out.cpu().double() - expected).abs().max().item()
        if backend == "torch":
            torch_err, bound = err, 8 * eps * max(1.0, expected.abs().max().item())
        else:
            bound = max(3 * torch_err, eps)
        rows.append([name, str(dtype).removeprefix("torch."), backend, f"{err:.2e}", f"{bound:.2e}",
                     "ok" if err <= bound else "FAIL"])
print(f"{'case':<18} {'dtype':<9} {'backend':<7} {'max |error| vs float64':>22} {'bound':>9}")
for row in rows:
    print(f"{row[0]:<18} {row[1]:<9} {row[2]:<7} {row[3]:>22} {row[4]:>9}  {row[5]}")
assert all(row[-1] == "ok" for row in rows)
print(f"\nall {len(rows)} comparisons within bounds")

# %% [markdown]
# ## GPU figures
#
# On a CUDA device this runs a small sweep of `bench/paged_kernels.py`: decode GB/s and prefill TFLOP/s of the Triton kernels
# next to contiguous SDPA on the same data. On a CPU there is nothing meaningful to time.

# %%
if ON_GPU and "triton" in BACKENDS:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "../bench/paged_kernels.py", "--batches", "1,32", "--contexts", "1024,8192",
                             "--prefill-lens", "1024"], capture_output=True, text=True, env=env)
    print(result.stdout, result.stderr[-2000:] if result.returncode else "")
    result.check_returncode()
else:
    print("GPU figures are not measured here (no CUDA device with Triton). On a CUDA machine run bench/gpu.sh, or "
          "python bench/paged_kernels.py for the kernel tables alone.")
