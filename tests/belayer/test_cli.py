"""`belayer`'s start-up errors: one line on stderr that says what to change, exit code 2."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

from belayer.cli import main
from belayer.cli.serve import SERVE_FLAGS
from belayer.testing.tiny_model import MARKER, check_target
from core.errors import ConfigError
from store import SqliteStore

DOCKER_DOWN = (
    "Docker is not running (nothing answers at unix:///nonexistent/docker.sock); start it with "
    "`sudo deploy/host/setup_sandbox_host.sh start`, or point DOCKER_HOST at a running engine"
)


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI; it must exit 2 with exactly one line on stderr, which is returned."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    return err.rstrip("\n")


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """`belayer serve` points the root logger at this test's (captured, soon closed) stderr: undo it,
    or every later test's log lines end in 'I/O operation on closed file'."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"belayer {version('belayer')}\n"


def test_serve_help_shows_every_flag_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for flag in ("--model", "--engine-url", "--workers", "--shadows", "--no-failover", "--sandboxes",
                 "--checkpoint-dir", "--checkpoint-policy", "--sandbox-port", "--admin-token",
                 "--max-failovers", "--stall-timeout", "--no-worker-wait", "--served-model-name",
                 "--max-model-len", "--store", "--host", "--port", "--public-url", "--max-body-bytes",
                 "--default-max-tokens", "--max-tokens-cap", "--model-alias", "--aux-model", "--log-dir",
                 "--log-level", "--config", "--api-token", "--plain-v1", "--allowed-hosts"):  # fmt: skip
        assert f" {flag} " in text
    assert all(f" {flag.name} " in text for flag in SERVE_FLAGS)  # and every flag of the table
    assert "seconds without a token before probing the worker (default: 5.0) [failover.stall_timeout]" in text
    assert "--checkpoint-policy {adaptive,always,never}" in text and "(default: adaptive)" in text
    assert "(default: on) [failover.enabled]" in text and "(default: policy; repeatable)" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine-url", "localhost:8001"], "--engine-url: 'localhost:8001' has no scheme; write it as http://localhost:8001"),
        (["--log-level", "loud"], "--log-level: input should be 'DEBUG', 'INFO', 'WARNING', 'ERROR' or 'CRITICAL' (got 'LOUD')"),
        (["--workers", "-1"], "--workers: input should be greater than or equal to 0 (got -1)"),
        (["--model-alias", "claude"], "--model-alias takes PATTERN=VALUE, e.g. 'claude-*=policy'; got 'claude'"),
        (["--aux-model", "x=litellm"], "--aux-model: auxiliary route for 'x' must be 'policy', 'reject' or 'http(s)://provider/v1#model'"),
    ],
)  # fmt: skip
def test_serve_rejects_a_bad_flag(
    args: list[str], message: str, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _fails(capsys, ["serve", "--model", str(tiny_model_dir), *args]) == f"belayer serve: {message}"


def test_serve_names_a_missing_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-model"
    assert _fails(capsys, ["serve", "--model", str(missing)]) == (
        f"belayer serve: --model: {missing} does not exist; give the directory that holds the model"
    )
    assert _fails(capsys, ["serve", "--model", str(tmp_path)]) == (
        f"belayer serve: --model: {tmp_path} holds no tokenizer.json; is it a Hugging Face model directory?"
    )


def test_serve_finds_its_port_in_use_before_launching_anything(
    busy_port: int, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = tmp_path / "logs"
    argv = ["serve", "--model", str(tiny_model_dir), "--port", str(busy_port), "--log-dir", str(logs)]
    assert _fails(capsys, argv) == (
        f"belayer serve: --port: 127.0.0.1:{busy_port} is already in use; stop what listens there or "
        "choose another port"
    )
    assert not logs.exists()  # no worker was launched


def test_docker_not_running(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    assert _fails(capsys, ["sandbox", "build-image"]) == f"belayer sandbox build-image: {DOCKER_DOWN}"
    bench = ["bench", "env-recovery", "--model", str(tiny_model_dir)]
    assert _fails(capsys, bench) == f"belayer bench: {DOCKER_DOWN}"
    serve = ["serve", "--model", str(tiny_model_dir), "--port", "0", "--sandboxes"]
    assert _fails(capsys, serve) == f"belayer serve: {DOCKER_DOWN}"


def test_export_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "missing.db"
    out = str(tmp_path / "t.jsonl")
    assert _fails(capsys, ["export", "--store", str(missing), "--format", "jsonl", "--out", out]) == (
        f"belayer export: --store {missing}: no such file; give the store `belayer serve` wrote: its --store, "
        "by default belayer-trajectories.db in the directory it ran in"
    )
    assert not missing.exists()  # not created as an empty store
    monkeypatch.chdir(tmp_path)
    assert _fails(capsys, ["export", "--format", "jsonl", "--out", out]) == (  # serve's default store
        f"belayer export: --store belayer-trajectories.db: no such file in {tmp_path}; give the store "
        "`belayer serve` wrote: its --store, by default belayer-trajectories.db in the directory it ran in"
    )
    db = tmp_path / "t.db"
    SqliteStore(str(db)).close()
    assert _fails(capsys, ["export", "--store", str(db), "--format", "parquet", "--out", str(tmp_path)]) == (
        f"belayer export: --out {tmp_path}: is a directory; give a file to write, e.g. --out "
        f"{tmp_path / 'rollouts.parquet'}"
    )
    monkeypatch.setenv("COLUMNS", "500")  # no wrapping
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--store STORE the trajectory store `belayer serve` wrote: its --store," in shown
    assert "(default: belayer-trajectories.db, serve's default)" in shown
    argv = ["export", "--store", str(db), "--format", "jsonl", "--out", out, "--session", "nope"]
    assert _fails(capsys, argv) == "belayer export: --session: no session 'nope' in the store"
    assert not Path(out).exists()


def test_tiny_model_never_overwrites_another_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "model.safetensors").write_bytes(b"weights")
    refusal = (
        f"{other} holds files that are not a Belayer tiny model (config.json, model.safetensors); it is "
        "never overwritten: give a new or empty directory"
    )
    assert _fails(capsys, ["model", "build-tiny", str(other)]) == f"belayer model build-tiny: {refusal}"
    assert _fails(capsys, ["demo", "--model-dir", str(other)]) == f"belayer demo: {refusal}"
    assert (other / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in other.iterdir()) == ["config.json", "model.safetensors"]


def test_tiny_model_targets(tmp_path: Path) -> None:
    check_target(tmp_path / "new")  # a new directory
    check_target(tmp_path)  # an empty one
    (tmp_path / MARKER).write_text("{}\n")
    (tmp_path / "model.safetensors").write_bytes(b"old tiny weights")
    check_target(tmp_path)  # a tiny model: rebuilt in place (make setup)
    with pytest.raises(ConfigError) as info:
        check_target(tmp_path / MARKER)
    assert (
        str(info.value)
        == f"{tmp_path / MARKER} is a file, not a directory; give a new directory for the tiny model"
    )
