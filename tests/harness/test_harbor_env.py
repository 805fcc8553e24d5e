"""Harbor's own runner on Belayer: ``harbor run --env belayer_harbor_env:BelayerEnvironment`` (the real
``harbor`` 0.25 package, in its own Python 3.12 venv, as a subprocess) against a real
``belayer serve --sandboxes`` (with ``--api-token``) in front of a scripted engine, on a real Docker engine
with CRIU.

Each test writes a Harbor task directory (task.toml, instruction.md, environment/Dockerfile FROM the
project's own python sandbox image, tests/test.sh writing /logs/verifier/reward.txt, solution/solve.sh),
runs one trial, and checks both sides: Harbor's trial result, and the Belayer session it became (found
by Harbor's trial id in the session's metadata).

- the oracle (solution/solve.sh): reward 1.0; the session holds every file and command of the trial
  as sandbox calls, has the reward, and is closed (its sandbox removed);
- terminus-2, Harbor's own agent, on the host (`BelayerTerminus2`), with the scripted policy: its three
  model calls are the session's three turns, each with a checkpoint of the sandbox (tmux and all) in
  its inference bubble; the sandbox's container is killed after the second one, the gateway restores
  it and replays the calls since, and the trial still gets reward 1.0.

The image of the terminus task holds this host's tmux (terminus-2 drives a tmux session in the
sandbox, and no package can be downloaded there). Harbor's venv is made once (PyPI).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from belayer.testing.services import ensure_harbor_venv
from gateway.policy.tokenization import ChatTokenizer
from tests.harness.test_episodes import API_TOKEN, Stack, kill_after_checkpoint, start_stack

pytestmark = [pytest.mark.harness, pytest.mark.docker]

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "harness_adapters" / "plugins"
MARKER = "HARBOR-HELLO"
INSTRUCTION = f"{MARKER}: write the word hello into /app/hello.txt."
TERMINUS_TURNS = [
    json.dumps(
        {
            "analysis": "The file does not exist yet.",
            "plan": "Write it with echo.",
            "commands": [{"keystrokes": "echo hello > /app/hello.txt\n", "duration": 0.1}],
            "task_complete": False,
        }
    ),
    json.dumps({"analysis": "The file holds hello.", "plan": "Done.", "commands": [], "task_complete": True}),
    # (the last turn repeats: terminus-2 asks once more before it ends, and gets task_complete again)
]
PARTS = 20
"""Files in solution/parts/ and verifier outputs: more than `TAR_ABOVE`, so both travel as one tar.gz."""
SOLVE_SH = f"""#!/bin/bash
[ "$(ls /solution/parts | wc -l)" = {PARTS} ] && echo hello > /app/hello.txt
"""
TEST_SH = f"""#!/bin/bash
for i in $(seq -w 1 {PARTS}); do echo "check $i" > /logs/verifier/check-$i.txt; done
if [ "$(cat /app/hello.txt 2>/dev/null)" = hello ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""
TMUX_LIBS = ("libevent_core", "libutempter")
"""tmux's libraries that the python sandbox image lacks (the rest are Debian minbase's)."""


@pytest.fixture(scope="module")
def harbor() -> Path:
    return ensure_harbor_venv(REPO / ".cache" / "harbor-venv").parent / "harbor"


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, docker_engine: None, python_image: str
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("harbor-gateway")
    yield from start_stack(
        tmp,
        tiny_model_dir,
        MARKER,
        TERMINUS_TURNS,
        crash=None,
        policy="always",
        engines=1,
        api_token=API_TOKEN,
    )


def write_task(root: Path, python_image: str, *, tmux: bool = False) -> Path:
    """A Harbor task directory whose answer is /app/hello.txt holding ``hello``."""
    for sub in ("environment", "tests", "solution"):
        (root / sub).mkdir(parents=True)
    (root / "task.toml").write_text(
        'schema_version = "1.4"\n\n[verifier]\ntimeout_sec = 120.0\n\n[agent]\ntimeout_sec = 300.0\n\n'
        '[environment]\nbuild_timeout_sec = 300.0\nworkdir = "/app"\nmemory_mb = 1024\n'
    )
    (root / "instruction.md").write_text(INSTRUCTION + "\n")
    dockerfile = [f"FROM {python_image}"]
    if tmux:
        dockerfile += [
            "COPY tmux /usr/local/bin/tmux",
            f"COPY {' '.join(copy_tmux(root / 'environment'))} /usr/local/lib/",
            "RUN ldconfig",
        ]
    dockerfile += ["RUN mkdir -p /app", "WORKDIR /app"]
    (root / "environment" / "Dockerfile").write_text("\n".join(dockerfile) + "\n")
    (root / "tests" / "test.sh").write_text(TEST_SH)
    (root / "solution" / "solve.sh").write_text(SOLVE_SH)
    (root / "solution" / "parts").mkdir()
    for i in range(PARTS):
        (root / "solution" / "parts" / f"{i:02}").write_text(f"part {i}\n")
    for script in (root / "tests" / "test.sh", root / "solution" / "solve.sh"):
        script.chmod(0o755)
    return root


def copy_tmux(context: Path) -> list[str]:
    """Copy this host's tmux and the libraries of `TMUX_LIBS` it links into the build context."""
    tmux = shutil.which("tmux")
    assert tmux is not None, (
        "terminus-2 needs tmux in its sandbox, copied from this host: apt-get install tmux"
    )
    shutil.copy(tmux, context / "tmux")
    ldd = subprocess.run(["ldd", tmux], capture_output=True, text=True, check=True).stdout
    libs = [line.split("=>")[1].split()[0] for line in ldd.splitlines() if line.strip().startswith(TMUX_LIBS)]
    assert len(libs) == len(TMUX_LIBS), ldd
    for lib in libs:
        shutil.copy(lib, context / Path(lib).name)
    return [Path(lib).name for lib in libs]


def harbor_run(
    harbor: Path, stack: Stack, tmp: Path, task: Path, *args: str, ok: bool = True
) -> dict[str, Any]:
    """Run one trial of `task` with ``harbor run`` on Belayer; return its trial result (which, unless
    `ok` is false, must be a success with the verifier's outputs downloaded)."""
    jobs = tmp / "jobs"
    env = {
        **os.environ,
        "PYTHONPATH": str(PLUGINS),
        "BELAYER_API_TOKEN": API_TOKEN,  # the trainer's token: Harbor is the trainer side here
        "HARBOR_TELEMETRY": "0",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # LiteLLM's own copy, not a download
        "OPENAI_API_KEY": "belayer",  # LiteLLM wants one; the session's URL is the capability
    }
    argv = [str(harbor), "run", "-p", str(task), "-o", str(jobs), "-n", "1", "-y", "-q"]
    argv += ["--env", "belayer_harbor_env:BelayerEnvironment", "--ek", f"gateway={stack.url}"]
    argv += ["--ek", "build_network=none", *args]
    done = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = jobs.glob("*/*/result.json")
    result: dict[str, Any] = json.loads(path.read_text())
    if not ok:
        return result
    assert result["exception_info"] is None, (path.parent / "exception.txt").read_text()
    verifier = path.parent / "verifier"  # downloaded from the sandbox, as one tar.gz
    assert sorted(p.name for p in verifier.glob("check-*.txt")) == [
        f"check-{i:02}.txt" for i in range(1, PARTS + 1)
    ]
    assert (verifier / "check-07.txt").read_text() == "check 07\n"
    return result


def belayer_session(stack: Stack, trial: dict[str, Any]) -> dict[str, Any]:
    """The session of Harbor trial `trial` (its id is in the session's metadata), with its trajectory."""
    sessions = stack.api("sessions?limit=100")["data"]
    [session] = [s for s in sessions if s["metadata"]["harbor"]["trial_id"] == trial["id"]]
    traj: dict[str, Any] = stack.api(f"sessions/{session['id']}/trajectory")
    return traj


def calls(traj: dict[str, Any]) -> list[dict[str, Any]]:
    return [e["data"] for e in traj["events"] if e["kind"] == "sandbox_call"]


def test_oracle_trial_is_a_belayer_session(
    harbor: Path, stack: Stack, tmp_path: Path, python_image: str
) -> None:
    task = write_task(tmp_path / "hello-task", python_image)
    args = ["--agent", "oracle", "--ek", "checkpoint_after_start=true", "--ek", "group={task}"]
    trial = harbor_run(harbor, stack, tmp_path, task, *args)
    assert trial["verifier_result"]["rewards"] == {"reward": 1.0}

    traj = belayer_session(stack, trial)
    session = traj["session"]
    assert (session["status"], session["reward"], session["num_turns"]) == ("closed", 1.0, 0)
    assert session["metadata"]["harbor"]["task"] == session["group"] == "hello-task"
    kinds = [e["kind"] for e in traj["events"]]
    assert kinds[0] == "sandbox_created" and kinds[-2:] == ["session_closed", "sandbox_destroyed"]
    created = traj["events"][0]["data"]
    assert created["image"].startswith("belayer-harbor-hello-task:") and created["network"] == "gateway"
    [checkpoint] = [e["data"] for e in traj["events"] if e["kind"] == "sandbox_checkpoint"]
    assert checkpoint["trigger"] == "explicit"  # --ek checkpoint_after_start=true
    writes = [c["args"]["path"] for c in calls(traj) if c["op"] == "write_file"]
    assert writes[0].startswith("/tmp/.belayer-upload-") and writes[0].endswith(".tar.gz")  # solution/
    assert writes[1:] == ["/logs/agent/oracle.txt", "/tests/test.sh"]
    commands = [c["args"]["command"] for c in calls(traj) if c["op"] == "exec"]
    assert any("/solution/solve.sh" in c and "cd -- /app" in c for c in commands)
    assert any("/tests/test.sh" in c for c in commands)
    assert stack.api(f"sessions/{session['id']}/sandbox", check=False)["error"]["code"] == "sandbox_not_found"


def test_terminus_2_trial_survives_its_sandbox_dying(
    harbor: Path, stack: Stack, tmp_path: Path, python_image: str, tokenizer: ChatTokenizer
) -> None:
    task = write_task(tmp_path / "hello-terminus", python_image, tmux=True)
    args = ["--agent", "belayer_harbor_env:BelayerTerminus2", "--model", "openai/policy"]
    args += ["--ak", "record_terminal_session=false"]
    done = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(harbor_run, harbor, stack, tmp_path, task, *args)
        run.add_done_callback(lambda _f: done.set())
        killed = kill_after_checkpoint(stack, 1, done)
        trial = run.result(timeout=600)
    assert trial["verifier_result"]["rewards"] == {"reward": 1.0}
    assert trial["agent_info"]["name"] == "terminus-2"

    traj = belayer_session(stack, trial)
    assert (traj["session"]["status"], traj["session"]["reward"]) == ("closed", 1.0)
    turns = traj["turns"]
    assert [t["status"] for t in turns] == ["complete"] * 3
    assert [tokenizer.decode(t["output_ids"]) for t in turns] == [*TERMINUS_TURNS, TERMINUS_TURNS[-1]]
    assert INSTRUCTION in turns[0]["request"]["messages"][0]["content"]
    checkpoints = [e["data"] for e in traj["events"] if e["kind"] == "sandbox_checkpoint"]
    assert {c["turn_index"] for c in checkpoints if c["in_bubble"]} >= {0, 1}
    [restored] = [e["data"] for e in traj["events"] if e["kind"] == "sandbox_restored"]
    assert restored["sandbox_id"] != killed["sandbox_id"] and restored["mode"] == "replay"
    assert restored["discarded_turns"] == []  # replayed: terminus-2 never noticed
    keys = [
        c["args"]["command"] for c in calls(traj) if c["op"] == "exec" and "send-keys" in c["args"]["command"]
    ]
    assert any("echo hello > /app/hello.txt" in k for k in keys)


def test_a_missing_base_image_is_an_error_that_names_it(
    harbor: Path, stack: Stack, tmp_path: Path, python_image: str
) -> None:
    task = write_task(tmp_path / "no-base", python_image)
    (task / "environment" / "Dockerfile").write_text("FROM belayer-no-such-base:1\nWORKDIR /app\n")
    before = stack.api("sessions?limit=100")["total"]
    trial = harbor_run(harbor, stack, tmp_path, task, "--agent", "oracle", ok=False)
    message = trial["exception_info"]["exception_message"]
    assert "base image 'belayer-no-such-base:1' is not on this Docker engine" in message
    assert "never pulls" in message and trial["verifier_result"] is None
    assert stack.api("sessions?limit=100")["total"] == before  # no session without its sandbox
