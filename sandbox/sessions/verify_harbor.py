"""Harbor's format of the verify stage (`sandbox.sessions.verify`, ``VerifyPlan.format="harbor"``).

The task's tests go to ``/tests`` (`harbor_tests_tar`, with the empty ``/logs`` directories its scripts
write to), ``/tests/test.sh`` runs, and the reward is what it wrote to ``/logs/verifier``: read through
the engine's archive (`reward_file`, no tool of the image) and judged as Harbor judges it
(`read_rewards`). A reward file that gives no reward is a `RewardFileError`, read into the verdict.
"""

from __future__ import annotations

import io
import json
import math
import tarfile

from core.errors import RewardFileError, SandboxFileNotFound
from sandbox.sessions.io import SandboxIO
from sandbox.sessions.verify_tree import files_tar

TESTS_DIR = "/tests"
LOGS_DIRS = ("/logs/agent", "/logs/verifier", "/logs/artifacts")
REWARD_JSON = "/logs/verifier/reward.json"
REWARD_TEXT = "/logs/verifier/reward.txt"
REWARD_MAX_BYTES = 64 * 1024
"""A reward file larger than this is not read (an error in the verdict)."""


def read_rewards(json_data: bytes | None, text_data: bytes | None) -> tuple[float, dict[str, float]]:
    """The RL reward and every reward, read as Harbor reads ``/logs/verifier``: ``reward.json`` (an object
    of finite numbers) wins over ``reward.txt`` (one finite number, ``{"reward": x}``); the reward is the
    ``reward`` key, or the only key. Anything else is a `RewardFileError`.

    >>> read_rewards(b'{"reward": 1, "tests": 0.5}', b"0"), read_rewards(None, b" 0.25\\n")
    ((1.0, {'reward': 1.0, 'tests': 0.5}), (0.25, {'reward': 0.25}))
    >>> read_rewards(b'{"score": 3}', None)
    (3.0, {'score': 3.0})
    >>> read_rewards(None, b"nan")
    Traceback (most recent call last):
    ...
    core.errors.RewardFileError: reward.txt holds 'nan', not one finite number
    """
    if json_data is not None:
        return _reward_of(_json_rewards(json_data))
    if text_data is not None:
        text = text_data.decode(errors="replace")
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not text.strip() or not math.isfinite(value):
            raise RewardFileError(
                "reward_file_invalid", f"reward.txt holds {text[:100]!r}, not one finite number"
            )
        return value, {"reward": value}
    raise RewardFileError("no_reward_file", f"tests/test.sh wrote neither {REWARD_JSON} nor {REWARD_TEXT}")


def _json_rewards(data: bytes) -> dict[str, float]:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RewardFileError("reward_file_invalid", f"reward.json is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise RewardFileError(
            "reward_file_invalid", f"reward.json holds {type(value).__name__}, not an object"
        )
    for key, item in value.items():
        if isinstance(item, bool) or not isinstance(item, int | float) or not math.isfinite(item):
            raise RewardFileError(
                "reward_file_invalid", f"reward.json's {key!r} is {item!r}, not a finite number"
            )
    return {str(k): float(v) for k, v in value.items()}


def _reward_of(rewards: dict[str, float]) -> tuple[float, dict[str, float]]:
    if "reward" in rewards:
        return rewards["reward"], rewards
    if len(rewards) == 1:
        return next(iter(rewards.values())), rewards
    raise RewardFileError(
        "no_reward_key", f"reward.json has keys {sorted(rewards)} and none is 'reward': which one is the reward?",
        rewards,
    )  # fmt: skip


def harbor_tests_tar(files: dict[str, tuple[bytes, int]]) -> bytes:
    """Harbor's tests under ``/tests``, and the empty ``/logs`` directories its scripts write to."""
    logs = {d.strip("/"): 0o777 for d in ("/logs", *LOGS_DIRS)}
    return files_tar("tests", files, {"tests": 0o755, **logs}, "test file")


async def reward_file(sandbox_io: SandboxIO, box: str, path: str) -> bytes | None:
    """The file at `path` in `box`, read through the engine's archive (no tool of the image); None
    when there is none."""
    buf = io.BytesIO()
    try:
        size = await sandbox_io.op(
            sandbox_io.backend.archive, box, path, buf, max_bytes=REWARD_MAX_BYTES + 4096
        )
    except SandboxFileNotFound:
        return None
    if size > REWARD_MAX_BYTES + 4096:
        raise RewardFileError("reward_file_invalid", f"{path} is over {REWARD_MAX_BYTES} bytes")
    buf.seek(0)
    with tarfile.open(fileobj=buf, mode="r:") as tar:
        member = tar.next()
        if member is None:
            return None
        stream = tar.extractfile(member) if member.isreg() else None
        if stream is None:
            raise RewardFileError("reward_file_invalid", f"{path} is not a regular file")
        return stream.read()
