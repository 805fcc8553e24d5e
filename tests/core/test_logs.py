"""The log formats: JSON lines carry a record's extras as fields and a traceback as ``exc``."""

from __future__ import annotations

import json
import logging
import sys

from core.logs import JsonFormatter, TextFormatter


def record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("belayer.test", logging.WARNING, __file__, 1, msg, args, None)
    rec.__dict__.update(extra)
    return rec


def failed() -> logging.LogRecord:
    try:
        raise ValueError('bad "value"\nsecond line')
    except ValueError:
        rec = record("it failed")
        rec.exc_info = sys.exc_info()
        return rec


def test_json_line_has_the_standard_fields_and_the_extras() -> None:
    line = JsonFormatter().format(record("worker %s lost", "w0", worker="w0", data={"token_index": 3}))
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed.pop("ts").endswith("Z")
    assert parsed == {
        "level": "warning",
        "logger": "belayer.test",
        "message": "worker w0 lost",
        "worker": "w0",
        "data": {"token_index": 3},
    }


def test_a_traceback_is_its_own_field_not_part_of_the_message() -> None:
    line = JsonFormatter().format(failed())
    assert "\n" not in line  # one line, whatever the traceback holds
    parsed = json.loads(line)
    assert parsed["message"] == "it failed"
    assert parsed["exc"].startswith("Traceback (most recent call last):")
    assert parsed["exc"].endswith('ValueError: bad "value"\nsecond line')


def test_an_extra_cannot_replace_a_standard_field_and_odd_values_become_text() -> None:
    parsed = json.loads(JsonFormatter().format(record("m", level="shouting", when=object)))
    assert parsed["level"] == "warning"
    assert parsed["when"] == "<class 'object'>"


def test_text_line_keeps_to_the_message_and_quotes_the_traceback() -> None:
    line = TextFormatter().format(failed())
    assert "\n" not in line
    assert ' msg="it failed" exc="Traceback' in line
