"""``torchrun --nproc-per-node N -m hf_paged serve --tp-plan auto ...``: one server over N tensor-parallel ranks.

Every rank loads the model with ``tp_plan="auto"`` (its share of each layer's heads) and builds the same engine
(the same pool settings; the ranks then agree on one block cap). Rank 0 serves HTTP: it tokenizes, schedules and
streams, and broadcasts each step's events to the others (see ``hf_paged/engine/distributed.py``). The other ranks
serve nothing: they run the steps rank 0 announces until it stops.

Shutdown: SIGTERM (or Ctrl-C) on rank 0 drains as the single-process server does (stop accepting, let running requests
finish for up to ``--drain-timeout``, cancel the rest); the stop then reaches every rank as an event, and each exits
0. A follower ignores SIGTERM and SIGINT (torchrun forwards them to every rank): it leaves when rank 0 says so, or
when rank 0 is gone. A lost rank (killed, crashed, unreachable for ``--tp-timeout`` seconds) stops the engine on
every surviving rank: rank 0's ``/health`` answers 503 with the reason, its server exits, and every survivor exits
with status 1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import uvicorn
from transformers import AutoModelForCausalLM, AutoTokenizer

from .. import embedded

log = logging.getLogger("hf_paged.serve")
LINGER_S = 2.0  # after a lost rank, rank 0 keeps answering /health (503, with the reason) this long before exiting


def init_process_group(timeout_s: float) -> None:
    """The default process group (under torchrun), with ``timeout_s`` on the model's collectives too."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise SystemExit("--tp-plan needs torchrun: torchrun --nproc-per-node N -m hf_paged serve --tp-plan auto ...")
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def tp_loader(tp_plan: str):
    """``load(path, dtype) -> (model, tokenizer)`` with the model sharded by ``tp_plan`` over the process group."""

    def load(path, dtype):
        path = path if path is not None else embedded.local_model_dir()
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, tp_plan=tp_plan, attn_implementation="sdpa")
        return model.eval(), tokenizer

    return load


def _stop_server_on_engine_error(manager, server) -> None:
    """Rank 0: when the engine stops on an error (a lost rank), make uvicorn exit."""
    while not manager.started and not server.should_exit:
        threading.Event().wait(0.1)
    if manager.started:
        manager.join()
    if manager.error is not None:
        log.error("the tensor-parallel engine stopped: %s; the server exits in %.0f s", manager.error, LINGER_S)
        threading.Event().wait(LINGER_S)  # /health answers 503 with the reason meanwhile
        server.should_exit = True


def serve(args, build) -> int:
    """Run rank ``RANK`` of the server; ``build(args, load=...)`` is ``hf_paged.serve.cli.build``."""
    init_process_group(args.tp_timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"hf_paged serve: tensor-parallel rank {rank}/{world}, pid {os.getpid()}", flush=True)
    app, what = build(args, load=tp_loader(args.tp_plan))
    manager = app.state.engine.manager
    if rank != 0:
        for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 decides when to stop; its stop reaches us as an event
            signal.signal(sig, lambda *_: log.info("rank %d: a signal; waiting for rank 0 to stop", rank))
        manager.start()
        for _ in manager:  # results are rank 0's to hand out: read and drop them here, until the engine stops
            pass
        manager.join()
        code = _exit_code(manager, rank)
        _leave(code)
        return code
    print(f"serving {what} on {world} tensor-parallel ranks at http://{args.host}:{args.port}/v1 "
          "(SIGTERM or Ctrl-C drains and stops every rank)", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=args.drain_timeout)
    server = uvicorn.Server(config)
    # uvicorn re-raises the SIGTERM it drained on once it returns; the engine has stopped every rank by then, so the
    # signal has nothing left to do and this rank exits like the others (0, or 1 after a lost rank).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    threading.Thread(target=_stop_server_on_engine_error, args=(manager, server), daemon=True,
                     name="hf_paged-tp-watch").start()
    server.run()
    manager.join()
    code = _exit_code(manager, rank)
    _leave(code)
    return code


def _exit_code(manager, rank: int) -> int:
    if manager.error is not None:
        print(f"hf_paged serve: rank {rank}: the tensor-parallel engine stopped: {manager.error}", file=sys.stderr,
              flush=True)
        return 1
    return 0


def _leave(code: int) -> None:
    """A clean exit tears the process group down; after a lost rank that could block, so the process just ends."""
    if code == 0:
        dist.destroy_process_group()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
