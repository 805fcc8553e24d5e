"""The verify route under the property-based fuzzer, with sandboxes on (the in-memory backend): drawn
bodies of both formats (Belayer's verify.sh, Harbor's tests/test.sh and reward files) and both modes
(clean, shared), with variables, protected paths and originals, mutated. Every answer is a 200 or a 400
in OpenAI's error shape that names a field of the body; a valid Harbor body's reward is the one its
reward files give (reward.json over reward.txt; anything else 0 with a reason)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_pool.fake import FakeEngine
from gateway.config import GatewayConfig
from sandbox.config import SandboxConfig
from sandbox.fake import FakeSandboxBackend, Shell
from tests.gateway import fuzzing
from tests.gateway.fuzzing import Mutation, check_answer
from tests.gateway.test_fuzz import LIMIT, fuzzer, started
from tests.gateway.test_fuzz_sandbox_files import SandboxFuzzGateway

FIELDS = {
    "files", "originals", "protected_paths", "on_tamper", "timeout_s", "image", "keep_sandbox", "format", "mode",
    "env",
}  # fmt: skip
REWARD_TEXTS = {"1": 1.0, " 0.25\n": 0.25, "nan": 0.0, "": 0.0, "x": 0.0, "1e400": 0.0, "-2": -2.0}
REWARD_JSONS = {
    '{"reward": 0.5, "tests": 1}': 0.5, '{"score": 2}': 2.0, '{"a": 1, "b": 2}': 0.0, "[1]": 0.0,
    '{"reward": true}': 0.0, '{"reward": NaN}': 0.0, "nope": 0.0, "{}": 0.0, '{"reward": "1"}': 0.0,
}  # fmt: skip
ENV_NAMES = ["REWARD_TXT", "REWARD_JSON", "MODE", "_x", "1BAD", "A-B", "", "é"]
ENV_VALUES = ["strict", "", "a b", "\u0000", "é🦀"]


def fake_test_sh(sh: Shell, argv: list[str]) -> int:
    """The fake's tests/test.sh: writes the reward files its variables hold, then fails (which must not
    count)."""
    for name, path in (
        ("REWARD_TXT", "/logs/verifier/reward.txt"),
        ("REWARD_JSON", "/logs/verifier/reward.json"),
    ):
        if name in sh.session.env:
            sh.files[path] = sh.session.env[name].encode()
    sh.print("tested\n")
    return 3


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@st.composite
def verify_bodies(draw: st.DrawFn) -> tuple[dict[str, Any], float | None]:
    """A verify body, and the reward it must get (None: not a Harbor body whose reward is known)."""
    fmt = draw(st.sampled_from(["harbor", "harbor", "belayer", "other"]))
    script = {"harbor": "test.sh", "belayer": "verify.sh"}.get(fmt, "test.sh")
    files = [{"path": script, "content": b64("exit 0\n"), "mode": 0o755}]
    if draw(st.booleans()):
        files.append(
            {"path": draw(st.sampled_from(["helper.py", "../up", "/abs", "a/b.txt"])), "content": b64("x")}
        )
    body: dict[str, Any] = {"files": files, "format": fmt}
    if draw(st.booleans()):
        body["mode"] = draw(st.sampled_from(["clean", "shared", "shared", "separate"]))
    txt = draw(st.none() | st.sampled_from(sorted(REWARD_TEXTS)))
    js = draw(st.none() | st.sampled_from(sorted(REWARD_JSONS)))
    env = {name: value for name, value in (("REWARD_TXT", txt), ("REWARD_JSON", js)) if value is not None}
    env |= draw(st.dictionaries(st.sampled_from(ENV_NAMES), st.sampled_from(ENV_VALUES), max_size=2))
    if env or draw(st.booleans()):
        body["env"] = env
    if draw(st.integers(0, 3)) == 0:
        body["protected_paths"] = ["test_*.py"]
        body["originals"] = [{"path": "test_a.py", "content": b64("orig\n")}]
    body["keep_sandbox"] = draw(st.booleans())
    body["timeout_s"] = draw(st.sampled_from([30, 0.5, 3600]))
    valid = fmt == "harbor" and len(files) == 1 and "originals" not in body and "\u0000" not in env.values()
    valid = valid and all(n in ("REWARD_TXT", "REWARD_JSON", "MODE", "_x") for n in env)
    expected = REWARD_JSONS[js] if js is not None else REWARD_TEXTS[txt] if txt is not None else 0.0
    return body, expected if valid else None


@pytest.fixture(scope="module")
def boxes(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[SandboxFuzzGateway]:
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path_factory.mktemp("fuzz-verify") / "traj.db"),
        store_synchronous="OFF",
        max_body_bytes=LIMIT,
        sandbox=SandboxConfig(enabled=True, sandbox_port=None),
    )
    backend = FakeSandboxBackend()
    backend.commands["/tests/test.sh"] = fake_test_sh
    gw = SandboxFuzzGateway(config, httpx.ASGITransport(FakeEngine(max_model_len=4096).app()), backend)
    with started(gw):
        yield gw


def test_the_verify_route_survives_drawn_and_mutated_requests(boxes: SandboxFuzzGateway) -> None:
    judged: list[tuple[str, int]] = []  # (format, status) of what was sent as drawn

    @fuzzer(0.04)
    @given(which=st.integers(0, 2), drawn=verify_bodies(), mutations=fuzzing.mutations)
    def example(which: int, drawn: tuple[dict[str, Any], float | None], mutations: list[Mutation]) -> None:
        body, expected = drawn
        sid = boxes.sessions[which]
        if boxes.call("GET", f"/api/sessions/{sid}/sandbox").status_code == 404:  # the last verify took it
            assert (
                boxes.call("POST", f"/api/sessions/{sid}/sandbox", json={"image": "img"}).status_code == 201
            )
        sent = fuzzing.apply(body, mutations)
        url = f"/api/sessions/{sid}/sandbox/verify"
        content = fuzzing.encode_json(sent).encode()
        r = boxes.call("POST", url, content=content, headers={"content-type": "application/json"})
        answer = check_answer("POST", url, r, f"POST {url} {content[:300]!r}")
        assert r.status_code in (200, 400, 413), r.text  # 413: a mutation grew the body past the limit
        if r.status_code == 400:  # it names a field of the body (or none, for a body that is no object)
            param = answer["error"]["param"]
            named = FIELDS | set(sent if isinstance(sent, dict) else ())
            assert param is None or param.split(".")[0] in named, r.text
        if not mutations:
            judged.append((str(body["format"]), r.status_code))
        if not mutations and expected is not None:
            assert r.status_code == 200, r.text
            assert (answer["reward"], answer["format"]) == (expected, "harbor"), (body, answer)
            assert answer["verified"] is (expected >= 1.0) and answer["exit_code"] == 3, answer
            assert answer["mode"] == body.get("mode", "clean")
            assert answer["reason"] is not None or answer["rewards"] is not None, (
                answer
            )  # a reward, or why not

    example()
    assert {("harbor", 200), ("belayer", 200), ("harbor", 400), ("other", 400)} <= set(judged), judged


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"format": "harbor"}, "files"),  # verify.sh is not test.sh
        ({"format": "xml"}, "format"),
        ({"mode": "separate"}, "mode"),
        ({"mode": "shared", "protected_paths": ["a"]}, "mode"),
        ({"mode": "shared", "image": "other"}, "mode"),
        ({"env": {"1BAD": "x"}}, "env"),
        ({"env": {"A": "\u0000"}}, "env"),
        ({"env": {"A": 1}}, "env"),
        ({"env": ["A"]}, "env"),
        (
            {"files": [{"path": "verify.sh", "content": b64("exit 0")}, {"path": "../x", "content": ""}]},
            "files",
        ),
    ],
)
def test_bad_verify_fields_are_a_400_naming_them(
    boxes: SandboxFuzzGateway, change: dict[str, Any], param: str
) -> None:
    sid = boxes.sessions[0]
    if boxes.call("GET", f"/api/sessions/{sid}/sandbox").status_code == 404:
        assert boxes.call("POST", f"/api/sessions/{sid}/sandbox", json={"image": "img"}).status_code == 201
    body = {"files": [{"path": "verify.sh", "content": b64("exit 0")}], **change}
    url = f"/api/sessions/{sid}/sandbox/verify"
    r = boxes.call("POST", url, json=body)
    answer = check_answer("POST", url, r, url)
    assert r.status_code == 400 and answer["error"]["param"].split(".")[0] == param, r.text
    assert answer["error"]["type"] == "invalid_request_error"
    assert boxes.call("GET", f"/api/sessions/{sid}/sandbox").status_code == 200  # nothing was judged
