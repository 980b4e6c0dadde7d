"""``python -m hf_paged serve``: an OpenAI-compatible HTTP server on the continuous-batching engine.

Without ``--model`` it serves the embedded SmolLM2-135M-Instruct. It binds to 127.0.0.1 unless told otherwise.
SIGTERM (or Ctrl-C) stops accepting connections, lets running requests finish for up to ``--drain-timeout`` seconds,
cancels what is left, and exits.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
import uvicorn

from .. import BlockPool, attach_paged_attention, embedded, init_continuous_batching
from ..engine.cpu_linears import native_dtype
from ..engine.lora import DEFAULT_MAX_LORAS
from .app import ServeSettings, create_app
from .distributed import serve as serve_distributed
from .media import (
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_PIXELS,
    FETCH_TIMEOUT_S,
    MAX_FETCH_BYTES,
    MediaPolicy,
    load_vision_model,
)
from .middleware import DEFAULT_MAX_BODY_BYTES
from .protocol import RequestLimits

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


# The server's step budget on every device: at concurrency 8 on a 2-core CPU, 2048 against the engine's CPU default of
# 512 gave the same tokens/s and inter-token gaps 1.34x llama-server's instead of 1.71x (first tokens 1.65 s instead
# of 0.80 s, llama-server's 2.44 s): docs/bench/cpu.md.
SERVE_BATCH_TOKENS = 2048


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_paged serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local model directory (default: the embedded SmolLM2)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-memory", default=None,
                   help="KV pool size, e.g. 4GiB (default: the engine sizes it for the machine)")
    p.add_argument("--kv-dtype", default="model", choices=["model", "fp8"],
                   help="KV block dtype: the model's, or fp8 (e4m3, twice the tokens of bf16)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights' dtype (auto: bfloat16 on a GPU and on a CPU that computes it natively, avx512_bf16 "
                        "or AMX; float32 on other CPUs). int8: int8 weight-only linears on the CPU (one scale per "
                        "output channel, bfloat16 activations; not the same function as bfloat16)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"],
                   help="paged attention kernels")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not keep finished prompts' blocks for reuse")
    p.add_argument("--arrival-window-ms", type=float, default=None,
                   help="an idle engine given requests waits until none has come for this long (at most 5 times it) "
                        "before its first step, so requests sent together are prefilled together (default: 10 on "
                        "CPU, 0 on CUDA; 0 turns it off)")
    p.add_argument("--max-batch-tokens", type=int, default=SERVE_BATCH_TOKENS,
                   help="token budget of one engine step (default %(default)s, as llama-server's batch: prompts that "
                        "arrive together are prefilled in one step, so none waits through the others' chunks after "
                        "its first token; smaller gives earlier first tokens and longer gaps between tokens, see "
                        "docs/bench/cpu.md)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every step eagerly (default on CUDA with --max-memory: decode steps replay CUDA graphs, "
                        "and the pool is allocated whole at start)")
    p.add_argument("--speculative", default=None, metavar="ngram|draft:PATH",
                   help="speculative decoding for requests that do not choose: 'ngram' (prompt lookup) or "
                        "'draft:PATH' (a small local model with the same tokenizer); a per-step policy runs drafts "
                        "only where they pay")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="draft tokens per request and step")
    p.add_argument("--max-queue", type=int, default=None,
                   help="waiting requests beyond which new ones get 429 with Retry-After (default: unbounded)")
    p.add_argument("--api-key", default=os.environ.get("HF_PAGED_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $HF_PAGED_API_KEY; none: open)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="larger request bodies get 413 (default 8 MiB)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds a shutdown waits for running requests before cancelling them")
    p.add_argument("--cors-origin", action="append", default=[], help="allow browser calls from this origin "
                   "(repeatable; '*' for any)")
    p.add_argument("--allowed-media-domains", nargs="*", default=[],
                   help="hosts (and their subdomains) chat image_url parts may fetch from (default: none; data: URLs "
                        "always work)")
    p.add_argument("--media-root", default=None, help="a directory file: image URLs may read from (default: none)")
    p.add_argument("--max-images", type=int, default=DEFAULT_MAX_IMAGES, help="images per chat request at most")
    p.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                   help="pixels (width x height, all images together) per chat request at most")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters to serve (directories saved by peft); a request chooses one by sending its "
                        "NAME as 'model'")
    p.add_argument("--max-loras", type=int, default=None,
                   help="adapters loaded at once (default 8, or the number of --lora-modules if more); past it the "
                        "least recently used idle one is unloaded")
    p.add_argument("--enable-lora-loading", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's shapes); needs "
                        "--lora-root (the --lora-modules adapters stay pinned: never replaced, unloaded or evicted)")
    p.add_argument("--lora-root", default=None,
                   help="the directory run-time adapter loads read from (lora_path is relative to it; nothing "
                        "outside it is read)")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="run-time adapter loads of a higher rank are refused (default: any)")
    p.add_argument("--limit", action="append", default=[], metavar="NAME=N",
                   help="raise or lower a cap on a list-valued request field (repeatable), e.g. --limit "
                        "logit_bias=1000; names and defaults: docs/guide/serving-clients.md")
    p.add_argument("--allowed-media-networks", nargs="*", default=[],
                   help="CIDRs a remote image's address may be in although not public (default: none; loopback, "
                        "private and link-local addresses are refused)")
    p.add_argument("--max-image-bytes", type=int, default=MAX_FETCH_BYTES, help="bytes of one fetched image at most")
    p.add_argument("--media-fetch-timeout", type=float, default=FETCH_TIMEOUT_S,
                   help="seconds one remote image fetch may take in all (redirects included)")
    p.add_argument("--tp-plan", default=None, choices=["auto"],
                   help="tensor parallelism under torchrun: torchrun --nproc-per-node N -m hf_paged serve --tp-plan "
                        "auto ... (rank 0 serves HTTP, the other ranks follow its steps)")
    p.add_argument("--tp-timeout", type=float, default=60.0,
                   help="seconds a rank waits for the others before stopping with an error (a lost rank)")
    _replica_arguments(p)
    return p


def _device(name: str):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def lora_modules(specs: list[str]) -> dict[str, str]:
    """``--lora-modules name=path ...`` as ``{name: path}``; ``ValueError`` naming a malformed entry."""
    out = {}
    for spec in specs:
        lora, sep, path = spec.partition("=")
        if not sep or not lora or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH entries (a directory saved by peft), got {spec!r}.")
        out[lora] = path
    return out


def build(args, load=None):
    """``(app, description)`` for parsed ``args``: loads the model, sizes the pool, starts nothing yet. ``load(path,
    dtype) -> (model, tokenizer)`` replaces the loader (tensor parallelism: ``serve/distributed.py``)."""
    if getattr(args, "enable_lora_loading", False) and not getattr(args, "lora_root", None):
        raise SystemExit("--enable-lora-loading needs --lora-root DIR: run-time loads read adapters only from under "
                         "it (lora_path is relative to it).")
    try:
        limits = RequestLimits.parse(getattr(args, "limit", []))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.threads:
        torch.set_num_threads(args.threads)
    device = _device(args.device)
    dtype = {"auto": native_dtype(device), "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "int8": torch.bfloat16}[args.dtype]
    if args.dtype == "int8" and device.type != "cpu":
        raise SystemExit(f"--dtype int8 runs int8 weight-only linears on the CPU; this server runs on {device}. "
                         "Pass --device cpu, or another --dtype.")
    name = args.served_model_name or (Path(args.model).resolve().name if args.model else EMBEDDED_NAME)
    print(f"loading {args.model or 'the embedded ' + EMBEDDED_NAME} ({dtype}, {device}) ...", flush=True)
    vision = load_vision_model(args.model, dtype) if args.model and load is None else None
    processor = None
    if vision is not None:  # a vision-language model: chat messages may carry images (serve/media.py)
        model, processor = vision
        tokenizer = processor.tokenizer
    else:
        model, tokenizer = (load or embedded.load)(args.model, dtype=dtype)
    if load is None:
        model.to(device)
    device = model.device
    attach_paged_attention(model, backend=args.backend)
    pool = BlockPool(block_size=args.block_size, max_memory=args.max_memory,
                     prefix_caching=not args.no_prefix_caching,
                     kv_dtype=torch.float8_e4m3fn if args.kv_dtype == "fp8" else None)
    speculative = getattr(args, "speculative", None)
    if speculative is not None and speculative != "ngram":
        if not speculative.startswith("draft:"):
            raise SystemExit(f"--speculative must be 'ngram' or 'draft:PATH', got {speculative!r}")
        speculative, _ = (load or embedded.load)(speculative.removeprefix("draft:"), dtype=dtype)
        if load is None:
            speculative.to(device)
    extra = {} if getattr(args, "num_speculative_tokens", None) is None else \
        {"num_speculative_tokens": args.num_speculative_tokens}
    loras = lora_modules(getattr(args, "lora_modules", []))
    max_loras = getattr(args, "max_loras", None) or max(DEFAULT_MAX_LORAS, len(loras))
    manager = init_continuous_batching(model, pool=pool, max_batch_tokens=args.max_batch_tokens,
                                       speculative=speculative, **extra,
                                       max_queue_size=args.max_queue,
                                       cuda_graphs=False if args.no_cuda_graphs else None,
                                       tp_timeout_s=getattr(args, "tp_timeout", 60.0), tokenizer=tokenizer,
                                       max_loras=max_loras,
                                       cpu_linears="int8" if args.dtype == "int8" else "auto",
                                       arrival_window_s=None if getattr(args, "arrival_window_ms", None) is None
                                       else args.arrival_window_ms / 1000)
    for lora, path in loras.items():
        manager.load_adapter(lora, path)
    settings = ServeSettings(model_name=name, api_key=args.api_key,
                             max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
                             drain_timeout=args.drain_timeout, cors_origins=tuple(args.cors_origin),
                             media=MediaPolicy(tuple(getattr(args, "allowed_media_domains", ())),
                                               Path(args.media_root) if getattr(args, "media_root", None) else None,
                                               getattr(args, "max_images", DEFAULT_MAX_IMAGES),
                                               getattr(args, "max_image_pixels", DEFAULT_MAX_PIXELS),
                                               tuple(getattr(args, "allowed_media_networks", ())),
                                               getattr(args, "max_image_bytes", MAX_FETCH_BYTES),
                                               getattr(args, "media_fetch_timeout", FETCH_TIMEOUT_S)),
                             lora_loading=getattr(args, "enable_lora_loading", False), lora_paths=loras,
                             limits=limits,
                             lora_root=Path(args.lora_root) if getattr(args, "lora_root", None) else None,
                             max_lora_rank=getattr(args, "max_lora_rank", None), max_loras=max_loras)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    app = create_app(manager, tokenizer, settings, vocab_size=vocab, processor=processor)
    weights = "int8 weights, bfloat16" if args.dtype == "int8" else dtype
    return app, f"{name} on {device} ({weights}, KV {args.kv_dtype}, block {args.block_size})"


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logging.getLogger("hf_paged.serve").warning("binding to %s without --api-key: anyone who can reach this "
                                                    "port can use the model", args.host)
    if args.replicas:  # Ray Serve: the 'replicas' extra, imported when asked for
        from .replicas import serve_replicas

        return serve_replicas(args, build)
    if args.tp_plan:
        return serve_distributed(args, build)
    app, what = build(args)
    print(f"serving {what} at http://{args.host}:{args.port}/v1 (SIGTERM or Ctrl-C drains and stops)", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=args.drain_timeout)
    uvicorn.Server(config).run()
    return 0


def _replica_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``--replicas`` (``hf_paged/serve/replicas.py``: replicas on Ray Serve)."""
    g = p.add_argument_group("replicas on Ray Serve (the 'replicas' extra; docs/guide/deployment.md)")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve N replicas (each its own model and engine) behind one endpoint, on Ray Serve")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (auto, or the head's address); default: start a local one")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs Ray reserves per replica (default 1, or an equal share of a local Ray instance's CPUs "
                        "when replicas x 1 does not fit beside the ingress)")
    g.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs per replica (default: 1 where the cluster has GPUs, else 0)")
    g.add_argument("--ingress-cpus", type=float, default=0.1, help="CPUs Ray reserves for the HTTP ingress")
    g.add_argument("--replica-tp", type=int, default=None,
                   help="tensor-parallel ranks per replica (a replica spanning N GPUs; --tp-plan auto is implied)")
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscale between --min-replicas (default --replicas) and this many replicas")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling's lower bound (0: scale to zero)")
    g.add_argument("--target-ongoing", type=float, default=32.0,
                   help="autoscaling's target of requests in flight per replica")
    g.add_argument("--routing", default="prefix", choices=["prefix", "pow2"],
                   help="prefix: requests sharing a prompt prefix go to the replica holding it (load wins when it "
                        "is busy); pow2: Ray's default (power of two choices)")
