"""``--load-format belayer_ipc``: vLLM's own ``ipc_cache`` loader (the weights of a ``vllm preload``
daemon, mapped over CUDA IPC), plus the one thing a weight update needs from a loader.

vLLM's ``reload_weights`` from a path (what ``POST /api/weights`` has every worker run) asks the
worker's loader for ``get_all_weights`` and refuses a loader without it: ``ipc_cache`` has none, so on
vLLM 0.32 a worker mapping the daemon cannot take a weight update ("Model reloading with `ipc_cache`
format"). This loader is ``ipc_cache`` in every other respect (the same socket, fingerprint, zero-copy
mapping and fallback to a disk load) and reads an update's weights from disk as vLLM's default loader
does. vLLM then writes them into the model's tensors in place (``reload.layerwise``: ``.data.copy_``),
which for a zero-copy mapper is the daemon's memory: `engine_pool.weights.cache` says why that is
consistent across the group's workers.

One difference from ``ipc_cache``: vLLM routes a speculative draft model to the daemon's draft group only
for the ``ipc_cache`` name, so with this loader a draft model loads from disk.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.weight_cache.ipc_loader import IpcModelLoader


@register_model_loader("belayer_ipc")
class ReloadableIpcLoader(IpcModelLoader):
    """``ipc_cache`` with ``get_all_weights``: an update's weights read from disk."""

    def get_all_weights(self, model_config: Any, model: nn.Module) -> Any:
        return DefaultModelLoader(self._fallback_load_config()).get_all_weights(model_config, model)
