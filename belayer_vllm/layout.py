"""A model's tensors in vLLM's own parameter layout, written to and mapped from the shared store.

vLLM's parameters are not the checkpoint's tensors: q, k and v are merged into ``qkv_proj``, gate and
up into ``gate_up_proj``, the vocabulary is padded. So the owner lays the weights out as vLLM's model
holds them *after* ``load_weights`` and *before* ``process_weights_after_loading`` (on CPU that step
repacks linear weights into oneDNN's private format, per process), and each worker maps that layout
and post-processes it itself. The key says which layouts match (`layout_key`).

Mapping is copy-on-write (``MAP_PRIVATE``): pages stay shared while read, and a worker that writes a
weight (a weight update) gets a private copy of just those pages, never touching its neighbours'.
Each tensor is its own mapping, so a tensor a worker drops (a weight vLLM repacked) is unmapped with it.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import torch
import vllm

from core import shm_weights
from core.errors import BelayerError

FORMAT = 1
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                               torch.int32, torch.int64, torch.bool, torch.float64)}  # fmt: skip


class LayoutUnavailable(BelayerError):
    """The owner's layout cannot be used (no live owner, not written yet, another model or config)."""


def layout_key(
    model_config: Any, tp: tuple[int, int], pp: tuple[int, int], checkpoint: str | None = None
) -> dict[str, Any]:
    """What must match for a worker to map a layout: the checkpoint (its owner directory's name:
    `checkpoint`, else the model's `checkpoint_hash`), architecture, dtype, parallel ranks,
    quantization, context length (rotary caches) and the vLLM version."""
    hf = model_config.hf_config
    return {
        "format": FORMAT,
        "checkpoint": checkpoint or shm_weights.checkpoint_hash(model_config.model),
        "arch": ",".join(getattr(hf, "architectures", None) or []),
        "dtype": str(model_config.dtype),
        "tp": list(tp),
        "pp": list(pp),
        "quantization": model_config.quantization,
        "max_model_len": model_config.max_model_len,
        "vllm": vllm.__version__,
    }


def layout_dir(base: str, key: dict[str, Any]) -> Path:
    return shm_weights.owner_dir(base, key["checkpoint"]) / shm_weights.layout_name(key)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer once (tied weights under their first name)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in seen and t.device.type != "meta":
            seen.add(id(t))
            out[name] = t.detach()
    return out


def write_layout(directory: Path, key: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    """Write `tensors` to ``weights.bin`` (page-aligned) and then the manifest; returns the bytes."""
    shm_weights.secure_dir(directory)  # 0700, this user's (the owner's directory above it, too)
    entries: dict[str, dict[str, Any]] = {}
    offset = 0
    tmp = directory / f".{shm_weights.WEIGHTS}.{os.getpid()}.tmp"
    with shm_weights.open_new(tmp) as f:  # O_EXCL|O_NOFOLLOW
        for name, t in tensors.items():
            data = t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
            f.seek(offset)
            f.write(data)
            entries[name] = {"dtype": str(t.dtype), "shape": list(t.shape), "offset": offset,
                             "nbytes": len(data)}  # fmt: skip
            offset += -(-len(data) // shm_weights.ALIGN) * shm_weights.ALIGN
        f.truncate(offset)
    os.replace(tmp, directory / shm_weights.WEIGHTS)
    shm_weights.write_json(
        directory / shm_weights.MANIFEST, {"key": key, "tensors": entries, "bytes": offset}
    )
    return offset


def open_layout(base: str, key: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The layout for `key` (its directory and manifest), if a live owner holds a complete one."""
    owner = shm_weights.owner_dir(base, key["checkpoint"])
    if not shm_weights.owner_alive(owner):
        raise LayoutUnavailable(f"no live weight owner for this checkpoint under {owner}")
    directory = layout_dir(base, key)
    manifest = shm_weights.read_json(directory / shm_weights.MANIFEST)
    if manifest is None:
        raise LayoutUnavailable(f"the owner has not laid out these weights (yet) in {directory}")
    if manifest.get("key") != key:
        raise LayoutUnavailable(f"the layout in {directory} is for another configuration")
    return directory, manifest


def map_tensor(weights: Path, entry: dict[str, Any]) -> torch.Tensor:
    """One tensor of ``weights.bin``, mapped copy-on-write (no copy, no read from disk)."""
    nbytes = int(entry["nbytes"])
    dtype = _DTYPES[entry["dtype"]]
    if nbytes == 0:
        return torch.empty(entry["shape"], dtype=dtype)
    with shm_weights.open_existing(weights) as f:  # O_NOFOLLOW
        region = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=int(entry["offset"]))  # fmt: skip
    return torch.frombuffer(region, dtype=dtype).view(entry["shape"])
