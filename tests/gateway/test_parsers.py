"""Tool-call and reasoning parsers per model family, at the token level: each model output is encoded
with the tiny model's tokenizer, decoded back by the gateway's incremental detokenizer, and fed to the
turn's real output pipeline (``TurnOutput.parse``: reasoning parser → tool parser) one token at a
time and in random chunkings; the exact events are asserted. Malformed output comes back as content
(never an exception), and no partial tag leaks into content."""

from __future__ import annotations

import itertools
import json
import random
import re
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.policy.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ContentDelta,
    MalformedToolCall,
    ReasoningDelta,
    ToolCall,
    forced_call_prefix,
    make_reasoning_parser,
    make_tool_parser,
)
from gateway.policy.streaming import StopTrimmer, tool_choice_prefix
from gateway.policy.tokenization import ChatTokenizer
from gateway.turns.output import TurnOutput
from tests.support import REPO

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "parameters": {
                "type": "object",
                "properties": {
                    "cmd": {"type": "string"},
                    "timeout": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "force": {"type": "boolean"},
                    "env": {"type": "object"},
                    "paths": {"type": "array", "items": {"type": "string"}},
                    "note": {"type": ["string", "null"]},
                    "mode": {"enum": ["fast", "slow"]},
                },
            },
        },
    }
]

Norm = tuple[str, Any]


def pieces(tok: ChatTokenizer, text: str) -> list[str]:
    """The detokenizer's text for each token of ``text`` (what the turn runner feeds the parsers)."""
    detok = tok.detokenizer()
    out = [detok.step(t) for t in tok.encode(text)]
    assert "".join(out) == text
    return out


def run(
    chunks: list[str], tool: str = "hermes", reasoning: str | None = None, tools: Any = TOOLS
) -> list[Any]:
    st = TurnOutput(
        None,  # type: ignore[arg-type]  # the pieces are decoded already
        StopTrimmer(()),
        make_tool_parser(tool, tools),
        make_reasoning_parser(reasoning),
    )
    events: list[Any] = []
    for chunk in chunks:
        events += st.parse(chunk)
    return events + st.parse("", final=True)


def norm(events: list[Any]) -> list[Norm]:
    """Consecutive content (and reasoning) merged; calls as (name, arguments JSON text)."""
    out: list[Norm] = []
    for ev in events:
        if isinstance(ev, ContentDelta | ReasoningDelta):
            kind = "content" if isinstance(ev, ContentDelta) else "reasoning"
            assert ev.text, "no empty deltas"
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + ev.text)
            else:
                out.append((kind, ev.text))
        elif isinstance(ev, ToolCall):
            out.append(("call", (ev.name, ev.arguments)))
        else:
            assert isinstance(ev, MalformedToolCall)
            out.append(("malformed", ev.raw))
    return out


def chunkings(tok: ChatTokenizer, text: str, seed: int, n: int = 12) -> list[list[str]]:
    """One token at a time, the whole text at once, and ``n`` random groupings of the tokens."""
    toks = pieces(tok, text)
    rng = random.Random(seed)
    out = [toks, ["".join(toks)]]
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(toks)), k=min(len(toks) - 1, rng.randint(1, 6))))
        out.append(["".join(toks[a:b]) for a, b in zip([0, *cuts], [*cuts, len(toks)], strict=True)])
    return out


def check(
    tok: ChatTokenizer, text: str, expected: list[Norm], tool: str = "hermes", reasoning: str | None = None
) -> list[Any]:
    """The exact events for every chunking; returns the token-at-a-time run's events."""
    first: list[Any] = []
    for i, chunks in enumerate(chunkings(tok, text, seed=len(text))):
        events = run(chunks, tool, reasoning)
        assert norm(events) == expected, f"chunking {i}: {chunks!r}"
        first = first or events
    return first


QWEN_CALL = (
    "<tool_call>\n<function=run>\n<parameter=cmd>\nls -la\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n"
    "<parameter=ratio>\n0.5\n</parameter>\n<parameter=force>\nfalse\n</parameter>\n"
    '<parameter=env>\n{"A": "1"}\n</parameter>\n<parameter=paths>\n["a", "b"]\n</parameter>\n'
    "<parameter=note>\nnull\n</parameter>\n<parameter=mode>\nfast\n</parameter>\n"
    "<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>"
)
QWEN_ARGS = {
    "cmd": "ls -la", "timeout": 30, "ratio": 0.5, "force": False, "env": {"A": "1"}, "paths": ["a", "b"],
    "note": None, "mode": "fast", "extra": "42",
}  # fmt: skip


def test_qwen3_coder_typed_by_schema_with_reasoning(tokenizer: ChatTokenizer) -> None:
    text = "<think>\nI should list.\n</think>\n\nLet me look." + QWEN_CALL
    events = check(
        tokenizer,
        text,
        [
            ("reasoning", "\nI should list.\n"),
            ("content", "\n\nLet me look."),
            ("call", ("run", json.dumps(QWEN_ARGS, ensure_ascii=False))),
        ],
        "qwen3_coder",
        "qwen3",
    )
    [call] = [e for e in events if isinstance(e, ToolCall)]
    assert call.index == 0 and re.fullmatch(r"call_[0-9a-f]{24}", call.id)


def test_qwen3_coder_two_calls_multiline_value_and_unknown_tool(tokenizer: ChatTokenizer) -> None:
    text = (
        "<tool_call>\n<function=run>\n<parameter=cmd>\nprintf 'a\n\nb'\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=other>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>\n"
    )
    check(
        tokenizer,
        text,
        [("call", ("run", '{"cmd": "printf \'a\\n\\nb\'"}')), ("call", ("other", '{"n": "7"}'))],
        "qwen3_coder",
    )


def test_qwen3_coder_bare_function_and_unterminated_call(tokenizer: ChatTokenizer) -> None:
    check(
        tokenizer,
        "ok <function=run>\n<parameter=timeout>\n5\n</parameter>\n</function> done",
        [("content", "ok "), ("call", ("run", '{"timeout": 5}')), ("content", " done")],
        "qwen3_coder",
    )
    # the model stopped before </function></tool_call>: accepted, as vLLM does
    check(
        tokenizer,
        "<tool_call>\n<function=run>\n<parameter=cmd>\npwd",
        [("call", ("run", '{"cmd": "pwd"}'))],
        "qwen3_coder",
    )


def test_qwen3_coder_malformed_is_content(tokenizer: ChatTokenizer) -> None:
    bad = "<tool_call>\nnot a function\n</tool_call>"
    check(tokenizer, "Hi " + bad + " bye", [("content", "Hi " + bad), ("malformed", bad), ("content", " bye")],
          "qwen3_coder")  # fmt: skip
    nameless = "<tool_call><function=></function></tool_call>"
    check(tokenizer, nameless, [("content", nameless), ("malformed", nameless)], "qwen3_coder")


def test_qwen3_coder_accepts_the_forced_hermes_prefix(tokenizer: ChatTokenizer) -> None:
    """A forced tool_choice starts the turn with the Hermes opening; the JSON body still parses."""
    text = '<tool_call>\n{"name": "run", "arguments": {"cmd": "ls"}}\n</tool_call>'
    check(tokenizer, text, [("call", ("run", '{"cmd": "ls"}'))], "qwen3_coder")


def test_llama3_json_calls(tokenizer: ChatTokenizer) -> None:
    one = '{"name": "run", "parameters": {"cmd": "ls", "timeout": 3}}'
    check(tokenizer, one, [("call", ("run", '{"cmd": "ls", "timeout": 3}'))], "llama3_json")
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1, 2]}}'
    check(tokenizer, two, [("call", ("a", "{}")), ("call", ("b", '{"x": [1, 2]}'))], "llama3_json")
    check(tokenizer, "Sure.<|python_tag|>" + one, [("content", "Sure."), ("call", ("run", '{"cmd": "ls", "timeout": 3}'))],
          "llama3_json")  # fmt: skip


def test_llama3_json_text_and_malformed(tokenizer: ChatTokenizer) -> None:
    check(tokenizer, "Hello, {world}.", [("content", "Hello, {world}.")], "llama3_json")
    for bad in ['{"answer": 42}', "{not json} at all", "<|python_tag|>"]:
        check(tokenizer, bad, [("content", bad), ("malformed", bad)], "llama3_json")
    # text after the calls is content again; text after a lone tag is malformed
    text = '{"name": "a", "parameters": {}} trailing words'
    check(tokenizer, text, [("call", ("a", "{}")), ("content", " trailing words")], "llama3_json")
    text = "<|python_tag|> not a call"
    check(tokenizer, text, [("content", "<|python_tag|> "), ("malformed", "<|python_tag|> "), ("content", "not a call")],
          "llama3_json")  # fmt: skip


def test_mistral_calls(tokenizer: ChatTokenizer) -> None:
    text = 'Checking.[TOOL_CALLS][{"name": "run", "arguments": {"cmd": "ls"}}, {"name": "run", "arguments": "{}"}]'
    events = check(
        tokenizer,
        text,
        [("content", "Checking."), ("call", ("run", '{"cmd": "ls"}')), ("call", ("run", "{}"))],
        "mistral",
    )
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [c.index for c in calls] == [0, 1]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in calls)
    check(tokenizer, '[TOOL_CALLS]run[ARGS]{"cmd": "pwd"}', [("call", ("run", '{"cmd": "pwd"}'))], "mistral")


def test_mistral_malformed_is_content(tokenizer: ChatTokenizer) -> None:
    for bad in ['[TOOL_CALLS][{"nom": 1}]', "[TOOL_CALLS] oops", "[TOOL_CALLS]"]:
        check(tokenizer, "A" + bad, [("content", "A" + bad), ("malformed", bad)], "mistral")


def test_hermes_unchanged(tokenizer: ChatTokenizer) -> None:
    text = 'Look.<tool_call>\n{"name": "run", "arguments": {"cmd": "ls"}}\n</tool_call>\n'
    check(tokenizer, text, [("content", "Look."), ("call", ("run", '{"cmd": "ls"}'))], "hermes")


def test_reasoning_parsers(tokenizer: ChatTokenizer) -> None:
    check(tokenizer, "<think>a</think>b", [("reasoning", "a"), ("content", "b")], reasoning="qwen3")
    check(tokenizer, "<think>a</think>b", [("reasoning", "a"), ("content", "b")], reasoning="deepseek_r1")
    # deepseek_r1: the template opened <think> in the prompt; qwen3 needs the tag
    check(tokenizer, "a</think>b", [("reasoning", "a"), ("content", "b")], reasoning="deepseek_r1")
    check(tokenizer, "a</think>b", [("content", "a</think>b")], reasoning="qwen3")
    check(tokenizer, "no thoughts", [("content", "no thoughts")], reasoning="qwen3")
    # cut by the token limit inside the reasoning: it stays reasoning (it streamed as such)
    check(tokenizer, "<think>still going", [("reasoning", "still going")], reasoning="qwen3")
    # reasoning, then a Hermes call parsed from the content
    text = '<think>x</think><tool_call>\n{"name": "run", "arguments": {}}\n</tool_call>'
    check(tokenizer, text, [("reasoning", "x"), ("call", ("run", "{}"))], "hermes", "qwen3")


@pytest.mark.parametrize("tool", TOOL_PARSERS)
def test_a_partial_tag_at_the_end_is_content_never_leaked_early(tokenizer: ChatTokenizer, tool: str) -> None:
    """A stream that ends in the middle of a tag: the held prefix comes out at the end, as content."""
    for tail in ["<tool_", "<think", "</thi", "[TOOL_CA", "<|python_", "<function"]:
        text = "Answer: 4 " + tail
        for chunks in chunkings(tokenizer, text, seed=3):
            events = run(chunks, tool, "qwen3")
            assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == text
            assert not [e for e in events if isinstance(e, ToolCall | ReasoningDelta)]


@pytest.mark.parametrize("tool", TOOL_PARSERS)
def test_no_partial_tag_reaches_content_mid_stream(tokenizer: ChatTokenizer, tool: str) -> None:
    """Fed token by token, the content emitted before a call's tag is complete never holds any of it."""
    calls = {
        "hermes": '<tool_call>\n{"name": "run", "arguments": {}}\n</tool_call>',
        "qwen3_coder": "<tool_call>\n<function=run>\n</function>\n</tool_call>",
        "llama3_json": '<|python_tag|>{"name": "run", "parameters": {}}',
        "mistral": '[TOOL_CALLS][{"name": "run", "arguments": {}}]',
    }
    text = "Doing it now." + calls[tool]
    parser = make_tool_parser(tool, TOOLS)
    content = ""
    for piece in pieces(tokenizer, text):
        content += "".join(e.text for e in parser.feed(piece) if isinstance(e, ContentDelta))
        assert text.startswith(content) and len(content) <= len("Doing it now.")
    events = parser.finish()
    assert content == "Doing it now." and [c.name for c in parser.calls] == ["run"] and not events


@pytest.mark.parametrize(
    ("tool", "continuation"),
    [
        ("hermes", '{"cmd": "ls"}}\n</tool_call>'),
        ("qwen3_coder", "<parameter=cmd>\nls\n</parameter>\n</function>\n</tool_call>"),
        ("llama3_json", '{"cmd": "ls"}}'),
        ("mistral", '{"cmd": "ls"}}]'),
    ],
)
def test_a_forced_call_opens_in_the_family_format(
    tokenizer: ChatTokenizer, tool: str, continuation: str
) -> None:
    """tool_choice forces a call by starting the turn with its opening: the family's own, which the
    parser is fed first and the model continues."""
    hermes, parse = tool_choice_prefix(["run"], None, "run")
    prefix = forced_call_prefix(tool, hermes)
    assert (
        parse
        and prefix
        == {
            "hermes": hermes,
            "qwen3_coder": "<tool_call>\n<function=run>\n",
            "llama3_json": '{"name": "run", "parameters": ',
            "mistral": '[TOOL_CALLS][{"name": "run", "arguments": ',
        }[tool]
    )
    assert forced_call_prefix(tool, prefix) == prefix  # translated once (the runner may see it twice)
    for chunks in chunkings(tokenizer, continuation, seed=1):
        assert norm(run([prefix, *chunks], tool)) == [("call", ("run", '{"cmd": "ls"}'))]
    # "required": the opening stops before the name, which the model writes
    required = forced_call_prefix(tool, tool_choice_prefix(["run"], "required")[0])
    rest = {"hermes": 'run", "arguments": ', "qwen3_coder": "run>\n", "llama3_json": 'run", "parameters": ',
            "mistral": 'run", "arguments": '}[tool] + continuation  # fmt: skip
    assert norm(run([required, *pieces(tokenizer, rest)], tool)) == [("call", ("run", '{"cmd": "ls"}'))]


def test_names_match_the_config_and_vllm() -> None:
    assert TOOL_PARSERS == ("hermes", "qwen3_coder", "llama3_json", "mistral")
    assert REASONING_PARSERS == ("qwen3", "deepseek_r1")
    with pytest.raises(ValueError, match="one of: hermes"):
        make_tool_parser("pythonic", None)


def test_the_parsers_import_neither_vllm_nor_torch() -> None:
    """The gateway stays light: its parsers (and the gateway app) load without vLLM or torch."""
    code = (
        "import sys, gateway.policy.parsers, gateway.app; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- properties: random soups of tags and text ----------------------------------------------------

SOUP = [
    "<tool_call>", "</tool_call>", "<function=", "run", ">", "</function>", "<parameter=", "cmd",
    "</parameter>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}", "[", "]",
    '"name"', ":", ",", ";", '"run"', '"arguments"', '"parameters"', "{}", "null", " ", "\n", "a", "é", "<",
    "|", "\\", '"', '{"name": "run", "parameters": {}}', '[{"name": "run", "arguments": {"cmd": 1}}]',
    "<function=run>\n<parameter=cmd>\nls\n</parameter>\n</function>",
    '<tool_call>\n{"name": "run", "arguments": {}}\n</tool_call>',
]  # fmt: skip


def expected_split(text: str, reasoning: str | None) -> tuple[str, str]:
    """(reasoning, content) the ``<think>`` rules give for a whole reply."""
    head = text.lstrip()
    opened = head.startswith("<think>")
    if reasoning is None or (reasoning == "qwen3" and not opened):
        return "", text
    rest = head[len("<think>") :] if opened else text
    thought, _, after = rest.partition("</think>")
    return thought, after


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(
    parts=st.lists(st.sampled_from(SOUP), max_size=30),
    cuts=st.lists(st.integers(0, 400), max_size=8),
    tool=st.sampled_from(TOOL_PARSERS),
    reasoning=st.sampled_from((None, *REASONING_PARSERS)),
)
def test_tag_soups_never_raise_and_round_trip(
    parts: list[str], cuts: list[int], tool: str, reasoning: str | None
) -> None:
    """Any text, in any chunking: no exception; the reasoning is what the ``<think>`` rules say; the
    events do not depend on the chunking (malformed blocks' raw text aside); and a reply with no call
    comes back as its exact text."""
    text = "".join(parts)
    points = sorted({c for c in cuts if c < len(text)} | {0, len(text)})
    chunks = [text[a:b] for a, b in itertools.pairwise(points)]
    chunked = norm(run(chunks, tool, reasoning))
    whole = norm(run([text], tool, reasoning))
    single = norm(run(list(text), tool, reasoning))

    def visible(events: list[Norm]) -> list[Norm]:
        out: list[Norm] = []
        for kind, value in events:
            if kind == "malformed":
                continue
            if out and out[-1][0] == kind == "content":
                out[-1] = (kind, out[-1][1] + value)
            else:
                out.append((kind, value))
        return out

    assert visible(chunked) == visible(whole) == visible(single)
    thought, content = expected_split(text, reasoning)
    assert "".join(v for k, v in whole if k == "reasoning") == thought
    if not [1 for k, _ in whole if k == "call"]:
        assert "".join(v for k, v in whole if k == "content") == content
    for kind, value in whole:
        if kind == "call":
            name, arguments = value
            assert isinstance(name, str) and isinstance(arguments, str)
