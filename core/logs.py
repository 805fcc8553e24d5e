"""How log lines look: ``text`` for a terminal, ``json`` (one object a line) for log shippers.

``belayer serve --log-format text|json`` installs one of these on the root logger. Structured values
travel as ``extra`` (``log.info("GET /health 200", extra={"status": 200})``): the JSON format writes
each as a field of its own; the text format keeps to the message, which says it all in words.
A traceback is a field too (``exc``), never text escaped into the message.

>>> record = logging.LogRecord("belayer.requests", logging.INFO, __file__, 1, "GET %s 200", ("/health",), None)
>>> record.created, record.msecs, record.status = 0.0, 0.0, 200
>>> JsonFormatter().format(record)
'{"ts": "1970-01-01T00:00:00.000Z", "level": "info", "logger": "belayer.requests", "message": "GET /health 200", "status": 200}'
>>> TextFormatter().format(record)
'ts=1970-01-01T00:00:00.000Z level=info logger=belayer.requests msg="GET /health 200"'
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from typing import Any, Literal

LogFormat = Literal["text", "json"]

_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",  # a LogRecord attribute from Python 3.12 on
    "color_message",  # uvicorn's own copy of a message, with terminal colours
}
"""What every LogRecord has; anything else on a record came through ``extra``."""


def _timestamp(record: logging.LogRecord) -> str:
    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{ts}.{int(record.msecs):03d}Z"


def extras(record: logging.LogRecord) -> dict[str, Any]:
    """The structured values a record carries (its ``extra``), in the order they were given."""
    return {key: value for key, value in vars(record).items() if key not in _STANDARD}


class TextFormatter(logging.Formatter):
    """One line: ``ts=… level=… logger=… msg="…"`` (and ``exc="…"`` with a traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"ts={_timestamp(record)} level={record.levelname.lower()} logger={record.name} msg={json.dumps(record.getMessage())}"
        if record.exc_info:
            line += f" exc={json.dumps(self.formatException(record.exc_info))}"
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts``, ``level``, ``logger``, ``message``, the record's extras, and
    ``exc`` (the traceback as one string) or ``stack`` when the record has one. A value JSON cannot
    hold is written as its ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in extras(record).items():
            line.setdefault(key, value)  # an extra named like a standard field does not replace it
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


def formatter(kind: LogFormat) -> logging.Formatter:
    """The formatter for ``--log-format``."""
    return JsonFormatter() if kind == "json" else TextFormatter()


def session_tag(session_id: str) -> str:
    """What logs show of a session id: a short digest, since the id itself is the capability to drive the
    session (``/s/{id}/…``); the sessions API shows the same tag (``log_tag``) to find a session's lines.

    >>> session_tag("ses_3f2a"), len(session_tag("x" * 64))
    ('s-1cec09b2865f', 14)
    """
    return "s-" + hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()


SESSION_ID = re.compile(r"\b(?:ses|req)_[0-9a-f]{32}\b")
"""A session id as the gateway makes them (``gateway.turns.sessions.SessionManager.new_record``): a named
session's ``ses_`` or a plain request's ``req_``, then 128 random bits in hex."""


def without_session_ids(text: str) -> str:
    """`text` with every session id in it shown as its tag: for log lines made of values that may hold
    one without saying so (a fork child's routing group is named after its parent's id; an error's
    message may name the session it is about).

    >>> without_session_ids("group ses_" + "0" * 32 + " on worker-1")
    'group s-3a10d22a2bf4 on worker-1'
    """
    return SESSION_ID.sub(lambda match: session_tag(match.group(0)), text)
