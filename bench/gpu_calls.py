"""Compiled PagedCache generate() call after call, on one pool (GPU): does every call replay the recorded graphs?

A random-weight bf16 model of Llama-3.2-1B's shape, 8 prompts x 512 tokens; five calls (4, 128, 128, 128 new tokens,
then 128 after a gc.collect()) on one BlockPool. Prints one JSON line per call: seconds, ms per step, whether the
step buffers came back to the pool, the dynamo graph count, inductor's CUDA-graph counters and the CUDA memory
allocated / reserved after the call (memory that grows call after call points at graphs recorded again into new pools).

    python bench/gpu_calls.py auto       # transformers' own compile (its default CompileConfig)
    python bench/gpu_calls.py explicit   # compile_config=CompileConfig(mode="reduce-overhead") passed in
"""

import gc
import json
import sys
import time

import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

from hf_paged import BlockPool, PagedCache, enable_paged_attention

if not torch.cuda.is_available():
    sys.exit("needs CUDA (transformers compiles generate() by itself only there).")
torch.manual_seed(0)
config = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192,
                     pad_token_id=0, bos_token_id=1, eos_token_id=None)
with torch.device("cuda"):
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
enable_paged_attention(model)
ids = torch.randint(2, config.vocab_size, (8, 512), device="cuda")
inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
pool = BlockPool(block_size=16, num_blocks=8 * 41 + 8)
mode = sys.argv[1] if len(sys.argv) > 1 else "auto"
extra = {}
if mode == "explicit":
    extra["compile_config"] = CompileConfig(fullgraph=False, mode="reduce-overhead")


def call(label: str, new: int) -> None:
    cache = PagedCache(model.config, pool=pool)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(**inputs, cache=cache, do_sample=False, max_new_tokens=new, min_new_tokens=new, **extra)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    buffers = id(cache.step_buffers)
    del cache
    print(json.dumps(dict(label=label, new_tokens=new, seconds=round(seconds, 3), ms_per_step=round(1e3 * seconds / new, 2),
                          step_buffers=buffers, free_step_buffers=len(pool._free_step_buffers),
                          graphs=counters["stats"]["unique_graphs"],
                          allocated_mib=round(torch.cuda.memory_allocated() / 2**20, 1),
                          reserved_mib=round(torch.cuda.memory_reserved() / 2**20, 1),
                          cudagraph={k: v for k, v in counters["inductor"].items() if "cudagraph" in k})), flush=True)


for new in (4, 128, 128, 128):
    call(mode, new)
gc.collect()
call(mode + " after gc.collect()", 128)
