"""Harbor-format tasks through `belayer run-episode` on a real Docker engine: a task written here (its
environment/Dockerfile built FROM the project's busybox image, offline; tests/test.sh writing Harbor's
reward files; solution/solve.sh), run by the ``oracle`` harness against a real ``belayer serve
--sandboxes`` and judged both ways: clean (a copy of the working directory in a new sandbox from the clean
image: Belayer's default) and shared (the agent's own sandbox: Harbor's). A solution that cheats outside
the working directory wins only in shared mode. Base images are checked before any build (a missing one
is an error naming it, never a pull) and mapped with ``--base-image``. mini-swe-agent, unchanged, solves
the same task with a scripted policy.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.errors import ImageBuildError
from harness_adapters.episode import EpisodeRunner
from harness_adapters.mini_swe_agent import MiniSweAgent
from harness_adapters.oracle import Oracle
from harness_adapters.scripted_engine import tool_call
from harness_adapters.task import Task, build_harbor_image
from sandbox.docker_backend import DockerSandboxBackend
from tests.harness.test_episodes import API_TOKEN, CACHE, Stack, start_stack
from tests.sandbox.conftest import busybox_image
from tests.support import belayer_argv

__all__ = ["busybox_image"]
pytestmark = pytest.mark.docker

DOCKERFILE = """\
FROM belayer-sandbox-busybox
WORKDIR /app
COPY greet.sh /app/greet.sh
RUN mkdir -p /usr/local/bin && printf '#!/bin/sh\\necho "hello, world"\\n' > /usr/local/bin/expected \\
    && chmod +x /usr/local/bin/expected
"""
GREET = 'echo "hello"\n'
TEST = """\
#!/bin/sh
# Harbor's contract: a reward file under /logs/verifier; the exit code does not count
got="$(sh greet.sh)"
if [ "$got" = "$(expected)" ]; then ok=1; else ok=0; fi
if [ "$REWARD_FORMAT" = json ]; then
    echo "{\\"reward\\": 0.5, \\"greeting\\": $ok}" > /logs/verifier/reward.json
fi
echo "$ok" > /logs/verifier/reward.txt
echo "greet.sh said: $got"
exit 3
"""
SOLVE = """\
#!/bin/sh
echo "echo \\"hello, $TARGET\\"" > greet.sh
echo solved
"""
CHEAT = """\
#!/bin/sh
# leaves greet.sh as it is, and makes the checker outside the working directory agree with it
printf '#!/bin/sh\\necho hello\\n' > /usr/local/bin/expected
echo 1 > /logs/verifier/reward.txt
"""
MINI_TURNS = [
    tool_call("bash", {"command": "sh greet.sh; pwd"}),
    tool_call("bash", {"command": "echo 'echo \"hello, world\"' > greet.sh"}),
    tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
]


def harbor_task(
    tmp: Path, name: str, *, solve: str = SOLVE, toml: str = "", dockerfile: str = DOCKERFILE
) -> Task:
    root = tmp / name
    for d in ("environment", "tests", "solution"):
        (root / d).mkdir(parents=True)
    (root / "task.toml").write_text(
        f'schema_version = "1.4"\n[metadata]\ndifficulty = "easy"\n{toml}\n'
        '[solution]\nenv = { TARGET = "world" }\n[environment]\nnetwork_mode = "no-network"\n'
    )
    (root / "instruction.md").write_text(f"{name.upper()}: make greet.sh greet the world.\n")
    (root / "environment" / "Dockerfile").write_text(dockerfile)
    (root / "environment" / "greet.sh").write_text(GREET)
    (root / "tests" / "test.sh").write_text(TEST)
    (root / "tests" / "test.sh").chmod(0o755)
    (root / "solution" / "solve.sh").write_text(solve)
    (root / "solution" / "solve.sh").chmod(0o755)
    return Task.load(root)


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, busybox_image: str
) -> Iterator[Stack]:
    """One scripted engine (mini's turns) and ``belayer serve --sandboxes`` with an API token."""
    tmp = tmp_path_factory.mktemp("harbor")
    yield from start_stack(
        tmp,
        tiny_model_dir,
        "HARBOR-MINI",
        MINI_TURNS,
        crash=None,
        policy="never",
        engines=1,
        api_token=API_TOKEN,
    )


def oracle(stack: Stack, **options: Any) -> EpisodeRunner:
    return EpisodeRunner(stack.url, Oracle(CACHE), api_token=stack.token, **options)


def check_report(report: dict[str, Any], reward: float, mode: str) -> None:
    assert (report["reward"], report["verified"], report["verify_mode"]) == (reward, reward == 1.0, mode), (
        report
    )
    assert report["verify_format"] == "harbor"
    assert report["verifier_exit_code"] == 3  # reported, and it did not count
    assert report["harbor"]["workdir"] == "/app"  # from the Dockerfile's WORKDIR


@pytest.mark.parametrize("mode", ["clean", "shared"])
def test_the_oracle_solves_a_harbor_task_in_either_mode(stack: Stack, tmp_path: Path, mode: str) -> None:
    """Per task: ``[metadata] belayer_verify``; [solution].env reaches solve.sh; no model call."""
    task = harbor_task(tmp_path, f"hello-{mode}", toml=f'belayer_verify = "{mode}"')
    report = oracle(stack).run(task)
    check_report(report, 1.0, mode)
    assert report["rewards"] == {"reward": 1.0}
    assert report["harness_ok"] is True and report["harness_report"]["solve_exit_code"] == 0
    assert "greet.sh said: hello, world" in report["verifier_output"]
    assert report["turns"] == 0  # the oracle asked no model
    session = stack.api(f"sessions/{report['session_id']}")
    assert session["reward"] == 1.0 and session["reward_info"]["verify_mode"] == mode


def test_a_solution_that_cheats_outside_the_workdir_wins_only_when_shared(
    stack: Stack, tmp_path: Path
) -> None:
    """By flag (``--verify``): the same cheat, judged in the agent's sandbox (reward 1) and on a copy of its
    working directory in a clean one (reward 0: the checker it rewrote and the reward file it planted are
    not there)."""
    task = harbor_task(tmp_path, "cheat", solve=CHEAT)
    clean = oracle(stack).run(task)
    shared = oracle(stack, verify="shared").run(task)
    check_report(clean, 0.0, "clean")
    check_report(shared, 1.0, "shared")
    assert "greet.sh said: hello" in clean["verifier_output"]


def test_reward_json_wins_over_reward_txt(stack: Stack, tmp_path: Path) -> None:
    """[verifier].env reaches test.sh, which writes both files: reward.json's ``reward`` is the reward."""
    task = harbor_task(tmp_path, "json", toml='[verifier]\nenv = { REWARD_FORMAT = "json" }')
    report = oracle(stack).run(task)
    assert (report["reward"], report["rewards"], report["verified"]) == (
        0.5,
        {"reward": 0.5, "greeting": 1.0},
        False,
    )
    traj = stack.api(f"sessions/{report['session_id']}")
    assert traj["reward"] == 0.5 and traj["reward_info"]["rewards"] == {"reward": 0.5, "greeting": 1.0}


def test_base_images_are_found_here_or_mapped_never_pulled(
    backend: DockerSandboxBackend, busybox_image: str, tmp_path: Path
) -> None:
    ubuntu = DOCKERFILE.replace("FROM belayer-sandbox-busybox", "ARG TAG=24.04\nFROM ubuntu:${TAG} AS base")
    task = harbor_task(tmp_path, "offline", dockerfile=ubuntu)
    with pytest.raises(ImageBuildError) as missing:
        build_harbor_image(task, {})
    message = str(missing.value)
    assert "builds from ubuntu:24.04, which is not on this host's Docker engine" in message
    assert "docker load -i ubuntu-24.04.tar" in message and "--base-image ubuntu:24.04=" in message
    assert not backend.has_image("ubuntu:24.04")  # nothing was pulled
    mapping = {"docker.io/library/ubuntu:24.04": busybox_image}
    built = build_harbor_image(task, mapping)
    again = subprocess.run(
        belayer_argv("task", "build", str(task.root), "--base-image", f"ubuntu:24.04={busybox_image}"),
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    plain = build_harbor_image(harbor_task(tmp_path, "plain"), {})
    try:
        assert built.cached is False and again.stdout.startswith(f"{built.name}  cached")
        labels = {img["name"]: img["labels"] for img in backend.images("belayer.task=offline")}
        assert labels[built.name]["belayer.task.base"] == busybox_image
        assert plain.name != built.name  # the same files FROM busybox unmapped: not the same key
    finally:
        backend.remove_image(built.name)
        backend.remove_image(plain.name)


def test_run_episode_takes_base_images_and_the_verify_mode_from_its_flags(
    stack: Stack, tmp_path: Path
) -> None:
    ubuntu = DOCKERFILE.replace("FROM belayer-sandbox-busybox", "FROM ubuntu:24.04")
    task = harbor_task(tmp_path, "cli", dockerfile=ubuntu)
    argv = belayer_argv(
        "run-episode", "--harness", "oracle", "--task", str(task.root), "--gateway", stack.url,
        "--base-image", "ubuntu:24.04=belayer-sandbox-busybox", "--verify", "shared", "--out", str(tmp_path / "r.json"),
    )  # fmt: skip
    env = {**os.environ, "BELAYER_API_TOKEN": API_TOKEN}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    check_report(report, 1.0, "shared")
    assert "reward=1.0 verify=shared" in done.stderr
    refused = subprocess.run(argv[:-6], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert refused.returncode == 2 and "builds from ubuntu:24.04" in refused.stderr


def test_a_harness_inside_gets_its_files_on_the_task_s_own_image(
    backend: DockerSandboxBackend, busybox_image: str, tmp_path: Path
) -> None:
    """Claude Code, Codex and OpenCode run inside the sandbox: on a Harbor task, from its image plus the
    harness's files (cached per task image and harness version)."""
    from sandbox.backend import SandboxSpec
    from sandbox.task_images import ensure_harness_layer

    task = harbor_task(tmp_path, "inside")
    base = build_harbor_image(task, {})
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\necho harness-ran\n")
    tool.chmod(0o755)
    layer = ensure_harness_layer(backend, task.name, base.name, "fake-harness", "1.0", {"/opt/h/tool": tool})
    again = ensure_harness_layer(backend, task.name, base.name, "fake-harness", "1.0", {"/opt/h/tool": tool})
    try:
        assert (layer.cached, again.cached, again.name) == (False, True, layer.name)
        assert layer.name != base.name and backend.image_workdir(layer.name) == "/app"
        box = backend.create(SandboxSpec(image=layer.name, workdir="/app"))
        try:
            assert backend.exec(box.id, "/opt/h/tool; sh greet.sh").stdout == "harness-ran\nhello\n"
        finally:
            backend.destroy(box.id)
    finally:
        backend.remove_image(layer.name)


def test_an_image_without_the_test_interpreter_is_refused_by_name(busybox_image: str, tmp_path: Path) -> None:
    task = harbor_task(tmp_path, "bash-less")
    (task.root / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    with pytest.raises(ImageBuildError, match=r"lacks /bin/bash \(tests/test.sh's interpreter\)"):
        build_harbor_image(task, {})


@pytest.mark.harness
def test_mini_swe_agent_solves_a_harbor_task(stack: Stack, tmp_path: Path) -> None:
    """A real harness beside its sandbox, its commands run in the task's WORKDIR (/app) of its own image."""
    task = harbor_task(tmp_path, "harbor-mini")
    report = EpisodeRunner(stack.url, MiniSweAgent(CACHE), api_token=stack.token).run(task)
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    assert report["harness_report"]["exit_status"] == "Submitted", report["harness_stderr_tail"]
    check_report(report, 1.0, "clean")
    assert report["turns"] == 3
    traj = stack.api(f"sessions/{report['session_id']}/trajectory")
    assert [t["status"] for t in traj["turns"]] == ["complete"] * 3
    execs = [
        e["data"]["args"] for e in traj["events"] if e["kind"] == "sandbox_call" and e["data"]["op"] == "exec"
    ]
    assert len(execs) >= 3, execs  # mini's three commands (and its own), all in the task's sandbox
