"""Policy weight versions: checking new weights before any worker sees them, and the durable record.

A trainer moves the policy to new weights with ``POST /api/weights`` (`gateway.api.weights`); the
engine pool does the update (`WeightUpdater.update`, ``pool.updater``). This module holds what the gateway adds:

- `check_weights`: the path must be a model directory the gateway can read (``config.json`` and
  ``*.safetensors`` / ``*.bin`` files) whose shapes match the served model's. vLLM 0.32's
  ``reload_weights`` takes the engine down when it cannot load a path (measured: the next request gets
  ``EngineDeadError`` and the server exits), so a path that cannot work is refused here, with a 400,
  before any worker sees it. Engines on other machines need the same path there (a shared file system).
- The record: every update is an event in the store, under the reserved session id `WEIGHTS_LOG`
  (``weights_updated``, or ``weights_update_failed``), which the store also publishes on the live
  feed. A restarted gateway takes its version from the newest one (`restore`), so the version it
  records on turns stays true; its launched workers are brought up to those weights before they serve.

Example::

    path = check_weights("/ckpt/step-120", "/models/policy")   # InvalidRequest when it cannot work
    result = await pool.updater.update("step-120", path, drain_s=30)
    record(store, result)  # the update's weights_updated event
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from core.errors import InvalidRequest
from core.events import WeightsUpdated, WeightsUpdateFailed
from engine_pool.pool import EnginePool
from store import EventRecord
from store.roles import EventLog, EventReads

WEIGHTS_LOG = "weights"
"""The session id the weight updates are recorded under in the store's events (no session has it)."""
VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+@/-]{0,127}")
"""A version name: it becomes a Prometheus label value and a column in exports, so it is kept plain."""
SHAPE_KEYS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
)  # fmt: skip
"""``config.json`` keys that must match the served model's: weights of another shape cannot load."""
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")


def check_version(version: str) -> str:
    """`version` if it is a plain name (`VERSION`), else an `InvalidRequest` (param ``version``)."""
    if not VERSION.fullmatch(version):
        raise InvalidRequest(
            f"version {version[:140]!r} is not a plain name: 1 to 128 letters, digits and ._:+@/- "
            "(starting with a letter or digit), e.g. 'step-120'",
            "version",
            "invalid_value",
        )
    return version


def check_weights(path: str, model_dir: str, root: str | None = None) -> str:
    """The absolute path of the weights at `path` when they can replace the served model's (module
    docstring) and lie in `root` (``--weights-root``, links resolved); an `InvalidRequest` (param
    ``path``) that says why not."""
    where = Path(path).expanduser()
    if not where.is_absolute():
        raise _bad(
            path, "is not an absolute path; give the directory's full path (the workers resolve it too)"
        )
    if root is not None:  # the resolved path goes on: a link changed after this check cannot lead out
        where = where.resolve()
        if not where.is_relative_to(Path(root).resolve()):
            raise _bad(
                path, f"lies outside the weights root {root} (--weights-root); save checkpoints under it"
            )
    if not where.is_dir():
        raise _bad(path, "is not a directory the gateway can read")
    config = _config(where)
    if config is None:
        raise _bad(path, "holds no readable config.json; give a model directory (save_pretrained's output)")
    if not any(next(where.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise _bad(path, "holds no weight files (*.safetensors, *.bin)")
    served = _config(Path(model_dir)) or {}
    for key in SHAPE_KEYS:
        if key in served and config.get(key) != served[key]:
            raise _bad(
                path,
                f"does not fit the served model: its config.json has {key}={config.get(key)!r}, the served "
                f"model's {served[key]!r}",
            )
    return str(where)


def _config(directory: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _bad(path: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"weights path {path[:300]!r} {why}", "path", "weights_not_loadable")


def record(store: EventLog, event: WeightsUpdated | WeightsUpdateFailed) -> None:
    """One weight update (``weights_updated``) or a failed one (``weights_update_failed``) in the store;
    the store publishes it on the live feed once it is committed."""
    store.add_event(EventRecord.of(WEIGHTS_LOG, None, event))


def history(store: EventReads) -> list[dict[str, Any]]:
    """Every recorded update, oldest first: ``{"ts", "kind", **data}``."""
    return [{"ts": e.ts, "kind": e.kind, **e.data} for e in store.get_events(WEIGHTS_LOG)]


def restore(store: EventReads, pool: EnginePool) -> str | None:
    """Before the pool starts: take the version of the newest recorded update (None: there is none,
    and the pool keeps its own). Engines given by URL are taken to hold it (they outlived the gateway);
    launched workers start from the model directory and are brought up to it (`EnginePool.start`)."""
    done = [e for e in store.get_events(WEIGHTS_LOG) if e.kind == "weights_updated"]
    if not done:
        return None
    latest = done[-1].data
    version = str(latest["version"])
    pool.updater.adopt(version, str(latest["path"]))
    return version
