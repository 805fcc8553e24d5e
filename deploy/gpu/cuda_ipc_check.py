#!/usr/bin/env python3
"""Can a worker's weights outlive the worker? A CUDA IPC check that needs only PyTorch.

An *owner* process allocates weight-like tensors on the device and keeps them. A *consumer* process
(standing in for an inference worker) maps them over CUDA IPC (``torch.multiprocessing``'s reduction
of CUDA tensors: ``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``), computes with them (a chain of
matrix-vector products, checked against the owner's own result), and is then killed with SIGKILL in
the middle of computing. The owner's tensors must be intact (a position-sensitive checksum of their
bits), and a second consumer must map them again and get the same result. This is what a shadow that
reuses an owner's GPU state relies on. Last, the owner itself is killed while the second consumer maps
its tensors, and the consumer computes again (``consumer_survives_owner_kill``; reported, not part of
the pass): whether a worker may still be promoted when the weight daemon it maps has died.

It prints ``name: value`` lines: sizes, times (``map_s``, ``compute_s``, ``remap_s`` after the kill,
``h2d_copy_s`` for the same bytes copied from host memory, as a reference) and the checks.

Exit codes: 0 every check passed, or skipped (``skipped: no CUDA device``, unless ``--require-gpu``);
1 a check failed; 2 bad arguments; 3 no CUDA device and ``--require-gpu``; 4 a step failed or timed out.

``--device cpu`` runs the same protocol with the tensors in shared memory: it checks this script
without a GPU (CI does), and says nothing about CUDA.

    python deploy/gpu/cuda_ipc_check.py                      # 2 GiB of float16 on cuda:0
    python deploy/gpu/cuda_ipc_check.py --mib 8192 --device-index 1 --require-gpu
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import queue
import signal
import statistics
import sys
import time
from typing import Any

OK, FAILED, USAGE, NO_GPU, BROKEN = 0, 1, 2, 3, 4
STEP_TIMEOUT = 300.0  # seconds any one step may take (a consumer's start includes importing torch)


class StepFailed(Exception):
    """A step of the check failed or timed out (exit code 4)."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="cuda_ipc_check.py",
        description="Owner holds tensors on the device; a consumer maps them over CUDA IPC, computes, is "
        "killed (SIGKILL); the owner's tensors stay intact and a new consumer maps them again. "
        "Prints name: value lines. Exit 0: passed (or skipped: no CUDA device); 1: a check failed; "
        "3: no CUDA device with --require-gpu; 4: a step failed or timed out.",
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda (default), or cpu: the same protocol in shared memory (tests the script)",
    )
    p.add_argument("--device-index", type=int, default=0, help="which CUDA device (default 0)")
    p.add_argument("--mib", type=int, default=2048, help="MiB of tensors the owner holds (default 2048)")
    p.add_argument("--dim", type=int, default=4096, help="each tensor is dim x dim (default 4096)")
    p.add_argument(
        "--dtype",
        choices=["float16", "bfloat16", "float32"],
        default=None,
        help="tensor type (default: float16 on cuda, float32 on cpu)",
    )
    p.add_argument("--require-gpu", action="store_true", help="no CUDA device is a failure (exit 3)")
    p.add_argument("--timeout", type=float, default=STEP_TIMEOUT, help="seconds per step (default 300)")
    return p.parse_args(argv)  # fmt: skip


# --- the tensors, and what is computed with them -----------------------------------------------------


def make_weights(args: argparse.Namespace, device: Any) -> list[Any]:
    import torch

    dtype = getattr(torch, args.dtype)
    per = args.dim * args.dim * dtype.itemsize
    count = max(1, args.mib * 1024 * 1024 // per)
    weights = []
    for i in range(count):
        g = torch.Generator(device=device).manual_seed(1000 + i)
        w = torch.randn(args.dim, args.dim, generator=g, device=device, dtype=torch.float32)
        weights.append((w / args.dim**0.5).to(dtype))
    return weights


def forward(weights: list[Any]) -> float:
    """A chain of matrix-vector products over every tensor (reads all of them), as one number."""
    import torch

    w0 = weights[0]
    x = torch.ones(w0.shape[1], device=w0.device, dtype=w0.dtype) / w0.shape[1] ** 0.5
    for w in weights:
        x = torch.tanh(w @ x)
    return float(x.double().sum().item())


def checksum(weights: list[Any]) -> int:
    """A position-sensitive sum of the tensors' bits: any changed element changes it."""
    import torch

    total = 0
    for i, w in enumerate(weights):
        bits = w.flatten().view(torch.int16 if w.element_size() == 2 else torch.int32).to(torch.int64)
        pos = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
        total += (i + 1) * int((bits * pos).sum().item())
    return total


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the processes -----------------------------------------------------------------------------------


def owner_main(args: argparse.Namespace, commands: Any, replies: Any, handles: Any) -> None:
    """Allocate, fill and keep the tensors; on ``share``, put them on the handles queue (torch's
    reduction sends CUDA IPC handles, not the bytes); on ``check``, recompute the checksum."""
    import torch

    device = torch.device(args.device, args.device_index) if args.device == "cuda" else torch.device("cpu")
    started = time.perf_counter()
    weights = make_weights(args, device)
    if device.type == "cpu":
        for w in weights:
            w.share_memory_()
    sync(device)
    alloc_s = time.perf_counter() - started
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory() if device.type == "cuda" else None
    h2d_s = None
    if host is not None:
        t0 = time.perf_counter()
        host.to(device, non_blocking=False)
        sync(device)
        h2d_s = time.perf_counter() - t0
        del host
    replies.put({
        "tensors": len(weights), "weights_mib": round(nbytes / 2**20, 1), "owner_alloc_s": alloc_s,
        "h2d_copy_s": h2d_s, "checksum": checksum(weights), "expected": forward(weights),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    })  # fmt: skip
    while True:
        command = commands.get()
        if command == "share":
            handles.put(weights)
            replies.put({"shared": True})
        elif command == "check":
            t0 = time.perf_counter()
            replies.put({"checksum": checksum(weights), "owner_check_s": time.perf_counter() - t0})
        else:
            return


def consumer_main(args: argparse.Namespace, handles: Any, replies: Any, commands: Any) -> None:
    """Map the owner's tensors, compute with them, report, then keep computing until killed; on
    ``report`` (from `commands`), compute once more and report the result and the checksum."""
    import torch

    t0 = time.perf_counter()
    if args.device == "cuda":
        torch.empty(1, device=torch.device("cuda", args.device_index))  # the CUDA context
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    weights = handles.get(timeout=args.timeout)  # rebuilt from IPC handles: the maps happen here
    device = weights[0].device
    sync(device)
    map_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    first = forward(weights)
    first_s = time.perf_counter() - t0
    steady = []
    for _ in range(5):
        t0 = time.perf_counter()
        forward(weights)
        steady.append(time.perf_counter() - t0)
    replies.put({
        "pid": os.getpid(), "init_s": init_s, "map_s": map_s, "compute_first_s": first_s,
        "compute_s": statistics.median(steady), "result": first,
    })  # fmt: skip
    while True:  # killed mid-compute, as a crashing worker would be
        forward(weights)
        with contextlib.suppress(queue.Empty):
            if commands.get_nowait() == "report":
                replies.put({"result": forward(weights), "checksum": checksum(weights)})


# --- the check ---------------------------------------------------------------------------------------


def reply(replies: Any, timeout: float, what: str, procs: list[Any]) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got: dict[str, Any] = replies.get(timeout=0.5)
            return got
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                raise StepFailed(f"{what}: process {dead[0].name} exited with {dead[0].exitcode}") from None
            if time.monotonic() > deadline:
                raise StepFailed(f"{what}: no answer within {timeout:.0f} s") from None


def consume(
    ctx: Any, args: argparse.Namespace, owner: Any, io: dict[str, Any], n: int
) -> tuple[Any, dict[str, Any]]:
    """Have the owner share its tensors, start consumer `n`, and wait for its report."""
    io["commands"].put("share")
    reply(io["replies"], args.timeout, "owner sharing", [owner])
    t0 = time.perf_counter()
    io[f"consumer-{n}"] = ctx.Queue()
    consumer_args = (args, io["handles"], io["results"], io[f"consumer-{n}"])
    proc = ctx.Process(target=consumer_main, args=consumer_args, name=f"consumer-{n}")
    proc.start()
    report = reply(io["results"], args.timeout, f"consumer {n}", [proc, owner])
    report["ready_s"] = time.perf_counter() - t0  # process start + torch import + context + map + compute
    return proc, report


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.multiprocessing as mp

    if args.device == "cuda":
        if not torch.cuda.is_available():
            return no_gpu(args)
        if args.device_index >= torch.cuda.device_count():
            say(f"error: no CUDA device {args.device_index} (this machine has {torch.cuda.device_count()})")
            return NO_GPU if args.require_gpu else USAGE
    args.dtype = args.dtype or ("float16" if args.device == "cuda" else "float32")
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    io = {name: ctx.Queue() for name in ("commands", "replies", "handles", "results")}
    owner = ctx.Process(
        target=owner_main, args=(args, io["commands"], io["replies"], io["handles"]), name="owner"
    )
    owner.start()
    procs = [owner]
    try:
        facts = reply(io["replies"], args.timeout, "owner start", [owner])
        show("device", f"{args.device}:{args.device_index} ({facts['device_name']})")
        show("torch", torch.__version__)
        for key in ("tensors", "weights_mib", "owner_alloc_s", "h2d_copy_s"):
            show(key, facts[key])

        first, r1 = consume(ctx, args, owner, io, 1)
        procs.append(first)
        show("consumer_ready_s", r1["ready_s"])
        show("cuda_init_s", r1["init_s"])
        show("map_s", r1["map_s"])
        show("compute_first_s", r1["compute_first_s"])
        show("compute_s", r1["compute_s"])
        same_1 = same(r1["result"], facts["expected"])

        t0 = time.perf_counter()
        os.kill(first.pid, signal.SIGKILL)
        first.join(args.timeout)
        show("kill_to_exit_s", time.perf_counter() - t0)
        if first.exitcode != -signal.SIGKILL:
            raise StepFailed(f"consumer 1 ended with {first.exitcode}, not by SIGKILL")

        io["commands"].put("check")
        check = reply(io["replies"], args.timeout, "owner check", [owner])
        intact = check["checksum"] == facts["checksum"]
        show("owner_check_s", check["owner_check_s"])

        second, r2 = consume(ctx, args, owner, io, 2)
        procs.append(second)
        show("remap_ready_s", r2["ready_s"])
        show("remap_s", r2["map_s"])
        show("recompute_s", r2["compute_s"])
        same_2 = same(r2["result"], facts["expected"])
        show("consumer_result_matches_owner", same_1)
        show("owner_tensors_intact_after_kill", intact)
        show("remapped_result_matches_owner", same_2)
        passed = same_1 and intact and same_2
        survives = owner_killed_under(second, owner, io, args.timeout, facts)
        show("consumer_survives_owner_kill", survives)
        show("result", "passed" if passed else "FAILED")
        return OK if passed else FAILED
    except StepFailed as exc:
        show("result", f"error: {exc}")
        return BROKEN
    finally:
        io["commands"].put("exit")
        for p in reversed(procs):
            if p.is_alive() and p is not owner:
                p.kill()
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)


def owner_killed_under(
    consumer: Any, owner: Any, io: dict[str, Any], timeout: float, facts: dict[str, Any]
) -> str:
    """Kill the owner (SIGKILL) while `consumer` maps its tensors and computes: do the consumer's tensors
    outlive it (the same bits, the same result)? Not part of the pass: it says whether a worker mapping
    a weight daemon that died may still be promoted (``engine_pool.weights.cache``), which CUDA's
    documentation leaves open for memory whose exporter is gone."""
    os.kill(owner.pid, signal.SIGKILL)
    owner.join(timeout)
    io[f"consumer-{consumer.name.rsplit('-', 1)[1]}"].put("report")
    try:
        got = reply(io["results"], min(timeout, 60.0), "consumer after the owner's kill", [consumer])
    except StepFailed as exc:
        return f"False ({exc})"
    kept = got["checksum"] == facts["checksum"] and same(got["result"], facts["expected"])
    return "True" if kept else "False (its tensors changed)"


def same(a: float, b: float) -> bool:
    """The same result up to rounding (the same kernels on the same bits agree; allow for the last place)."""
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)


def no_gpu(args: argparse.Namespace) -> int:
    if args.require_gpu:
        say("error: no CUDA device (torch.cuda.is_available() is False); run this on a GPU machine")
        return NO_GPU
    say("skipped: no CUDA device")
    return OK


def say(line: str, stream: Any = None) -> None:
    out = stream or sys.stdout
    out.write(line + "\n")
    out.flush()


def show(name: str, value: object) -> None:
    if isinstance(value, float):
        value = f"{value:.4f}"
    say(f"{name}: {value}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.mib < 1 or args.dim < 1 or args.timeout <= 0:
        say("error: --mib, --dim and --timeout must be positive", sys.stderr)
        return USAGE
    try:
        import torch  # noqa: F401
    except ImportError:
        if args.require_gpu:
            say("error: PyTorch is not installed (pip install torch)")
            return NO_GPU
        say("skipped: PyTorch is not installed")
        return OK
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
