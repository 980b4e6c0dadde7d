"""The continuous-batching engine: many requests served from one shared BlockPool.

- ``scheduler.py``: who runs in the next forward, and with how many tokens (tensor-free);
- ``kv.py``: the requests' rows on the pool and the block arithmetic admission needs;
- ``runner.py``: one packed forward per step through the shared step planner;
- ``sampling.py``: per-request sampling;
- ``beams.py``: beam search, a request as a group of rows;
- ``speculative.py``: speculative decoding (proposers, verification, the per-step policy);
- ``core.py``: one step (schedule, run, sample, record);
- ``handoff.py``: what user threads and the engine thread pass each other (requests in, results out, stop), and its
  locking rule;
- ``loop.py``: the engine thread (single-process, and tensor-parallel over ``distributed.py``'s channel);
- ``manager.py``: ``ContinuousBatchingManager``, the user-facing API;
- ``factory.py``: ``init_continuous_batching`` (builds the engine for a model) and ``generate_batch``;
- ``transformers_api.py``: transformers' ``model.generate_batch`` & co. on a paged model, routed here;
- ``outputs.py``: what comes back (``GenerationOutput``, ``RequestStatus``, ``EngineStats``) and the errors.
"""

from .outputs import EngineStats, GenerationOutput, QueueFullError, RequestStatus, RequestTooLargeError

__all__ = ["EngineStats", "GenerationOutput", "QueueFullError", "RequestStatus", "RequestTooLargeError"]
