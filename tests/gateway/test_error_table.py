"""One table maps the exception tree to HTTP: every error a request can meet has an entry."""

from __future__ import annotations

import inspect

import core.errors as errors
from gateway.http.errors import TABLE, entry_for, error_body, for_exception, for_route, is_anthropic_path
from gateway.observe.metrics import protocol_of

# Errors that never reach a client: start-up, harness programs, task directories and benches (CLI-side);
# a Harbor task's reward files are read into the verdict (its reason), never answered as an error.
OFFLINE = {
    errors.BelayerError, errors.ConfigError, errors.HarnessError, errors.TaskError, errors.RewardFileError,
    errors.BenchError,
}  # fmt: skip


def test_every_error_class_has_a_table_entry_and_no_instance_status() -> None:
    classes = [
        c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.BelayerError)
    ]
    assert len(classes) >= 30
    for cls in classes:
        if cls in OFFLINE:
            continue
        assert entry_for(cls.__new__(cls)) is not None, cls
        assert "status" not in vars(cls), cls  # the status is the table's, never the class's


def test_the_most_specific_entry_wins() -> None:
    assert for_exception(errors.ImageNotFound("no image x"))[0] == TABLE[errors.ImageNotFound].status == 400
    assert for_exception(errors.NoSandbox("none"))[1]["error"]["code"] == "sandbox_not_found"
    status, body = for_exception(errors.InvalidRequest("bad", "messages", "invalid_json"))
    assert (status, body["error"]["param"], body["error"]["code"]) == (400, "messages", "invalid_json")
    status, body = for_exception(errors.SandboxTimeout("ran 5s", stdout="partial"))
    assert status == 408 and body["error"]["message"].endswith("Output before the kill: 'partial'")


def test_one_function_chooses_the_error_shape_by_route() -> None:
    """`for_route` serves the table's handlers (a request's path), the server's own refusals (the raw
    request target, with its query) and the sandbox listener's (a session-prefixed path)."""
    body = error_body("no", "invalid_request_error")
    anthropic = {"type": "error", "error": {"type": "invalid_request_error", "message": "no"}}
    for target in ("/v1/messages", "/v1/messages?beta=true", "/s/ses_1/v1/messages/count_tokens"):
        assert is_anthropic_path(target) and for_route(target, 400, body) == anthropic, target
    for target in ("/v1/chat/completions", "/s/a/v1/responses", "/v1/messagesx", "/health?x=/v1/messages"):
        assert not is_anthropic_path(target) and for_route(target, 400, body) is body, target
    assert protocol_of("/s/ses_1/v1/messages") == "anthropic" and protocol_of("/v1/messagesx") == "openai"
