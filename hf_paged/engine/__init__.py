"""The continuous-batching engine: many requests served from one shared BlockPool.

- ``scheduler.py``: who runs in the next forward, and with how many tokens (tensor-free);
- ``kv.py``: the requests' rows on the pool and the block arithmetic admission needs;
- ``runner.py``: one packed forward per step through the shared step planner;
- ``sampling.py``: per-request sampling;
- ``core.py``: one step (schedule, run, sample, record);
- ``api.py``: ``init_continuous_batching``, ``generate_batch``, the manager and its engine thread;
- ``outputs.py``: what comes back (``GenerationOutput``, ``RequestStatus``, ``EngineStats``) and the errors.
"""

from .outputs import EngineStats, GenerationOutput, QueueFullError, RequestStatus, RequestTooLargeError

__all__ = ["EngineStats", "GenerationOutput", "QueueFullError", "RequestStatus", "RequestTooLargeError"]
