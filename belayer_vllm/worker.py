"""The worker extension of ``belayer_shm`` engines (``--worker-extension-cls
belayer_vllm.worker.SharedWeights``, which ``engine_pool.weights.owner.loader_args`` adds): vLLM mixes this
class into its worker, so that ``POST /collective_rpc`` can call `SharedWeights.belayer_remap_weights` on
each model worker (vLLM runs such calls between engine steps, never during one).

Why not vLLM's ``reload_weights``: in vLLM 0.32 it reads the loader's ``get_all_weights`` and copies them
into the model (``model_executor/model_loader/reload``), which is exactly what makes the pages private; a
re-map must instead replace the tensors, and load nothing.
"""

from __future__ import annotations

from typing import Any

from belayer_vllm import layout


class SharedWeights:
    """Mixed into vLLM's worker class; its methods see the worker as ``self``. Its method's name is
    ``core.shm_weights.REMAP``, the one the pool calls."""

    def belayer_remap_weights(self, weights_path: str) -> dict[str, Any]:
        """Point the model's weights back at the current weight owner's pages (`SharedMemoryLoader.
        remap`), which must hold the weights at `weights_path`. Never raises: a worker that cannot re-map
        keeps its own copy, and says why (``{"source": None, "why": ...}``)."""
        from vllm.model_executor.model_loader import get_model_loader

        from belayer_vllm.loader import SharedMemoryLoader

        worker: Any = self  # vLLM's worker, with this class among its bases
        loader = get_model_loader(worker.vllm_config.load_config)
        if not isinstance(loader, SharedMemoryLoader):
            return {"source": None, "why": f"load format {worker.vllm_config.load_config.load_format!r}"}
        try:
            return loader.remap(worker.get_model(), worker.vllm_config.model_config, weights_path)
        except (layout.LayoutUnavailable, OSError) as e:
            return {"source": None, "why": str(e)}
