"""Stop strings and Hermes tool-call parsing, including tags split across chunks."""

from __future__ import annotations

import json

import pytest

from gateway.policy.streaming import ContentDelta, HermesToolParser, MalformedToolCall, StopTrimmer, ToolCall

CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'


def run(parser: HermesToolParser, pieces: list[str]) -> list[object]:
    events: list[object] = []
    for p in pieces:
        events += parser.feed(p)
    return events + parser.finish()


def content(events: list[object]) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentDelta))


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_tool_call_split_anywhere(size: int) -> None:
    text = "Let me look." + CALL + "\n" + CALL.replace("ls -la", "pwd")
    events = run(HermesToolParser(), [text[i : i + size] for i in range(0, len(text), size)])
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert content(events) == "Let me look."
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "bash", {"command": "ls -la"}),
        (1, "bash", {"command": "pwd"}),
    ]


def test_malformed_tool_json_stays_content() -> None:
    bad = '<tool_call>\n{"name": "bash", "arguments": {"command": }\n</tool_call>'
    events = run(HermesToolParser(), ["ok ", bad[:9], bad[9:]])
    assert content(events) == "ok " + bad
    assert not [e for e in events if isinstance(e, ToolCall)]
    [err] = [e for e in events if isinstance(e, MalformedToolCall)]
    assert err.raw == bad and "invalid JSON" in err.reason


def test_unterminated_call_is_accepted_when_json_is_complete() -> None:
    events = run(HermesToolParser(), ['<tool_call>\n{"name": "f", "arguments": {"a": 1}}'])
    [call] = [e for e in events if isinstance(e, ToolCall)]
    assert (call.name, json.loads(call.arguments)) == ("f", {"a": 1})


def test_partial_tag_prefix_is_flushed_as_content() -> None:
    assert content(run(HermesToolParser(), ["a <tool", "_ca"])) == "a <tool_ca"


def test_disabled_parser_passes_text_through() -> None:
    assert content(run(HermesToolParser(enabled=False), [CALL])) == CALL


@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_stop_trimmer(size: int) -> None:
    text = "hello STOP world END more"
    t = StopTrimmer(("END", "STOP"))
    out = "".join(t.feed(text[i : i + size]) for i in range(0, len(text), size)) + t.finish()
    assert out == "hello " and t.stopped


def test_stop_trimmer_holds_back_partial_stop_until_finish() -> None:
    t = StopTrimmer(("STOP",))
    assert t.feed("abc ST") == "abc "
    assert t.finish() == "ST"
