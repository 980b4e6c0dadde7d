"""Which weights a model holds now, cheaply: for noticing that K/V kept in a pool was computed with other weights.

A model's *weights version* is, per parameter and buffer, its storage address and torch's version counter (bumped
by every in-place change: ``optimizer.step()``, ``load_state_dict``, ``p.data.copy_``, loading an adapter's weights
into its layers). A tensor replaced by another (``load_state_dict(assign=True)``, ``model.to(dtype)``) changes the
address. Reading it costs a pass over the tensors (no data is read): about 0.1-0.2 µs per tensor on the host.

Not seen: switching which of several loaded adapters is active (no tensor changes; give each adapter its own
key-chain root, or call the pool's ``reset_prefix_cache()``), and tensors made under ``torch.inference_mode()``
(they keep no version counter: a changed one is noticed only if its address changes).
"""

from __future__ import annotations

import itertools

from torch import nn


def weights_version(model: nn.Module) -> tuple:
    """``(storage address, version counter)`` of each parameter and buffer of ``model``, in module order."""
    out = []
    for t in itertools.chain(model.parameters(), model.buffers()):
        try:
            version = t._version
        except RuntimeError:  # an inference tensor: no version counter
            version = -1
        out.append((t.data_ptr(), version))
    return tuple(out)


class WeightsWatch:
    """Remembers the weights version of the model it last saw.

    Example::

        watch = WeightsWatch()
        watch.changed(model)     # False: first sight
        optimizer.step()
        watch.changed(model)     # True: parameters changed in place since
    """

    def __init__(self):
        self._model_id: int | None = None
        self._version: tuple | None = None

    def changed(self, model: nn.Module) -> bool:
        """Whether ``model`` (or another model) holds other weights than at the last call; the first call is False."""
        version = weights_version(model)
        seen = self._version is not None
        changed = seen and (id(model) != self._model_id or version != self._version)
        self._model_id, self._version = id(model), version
        return changed
