"""The dashboard names every kind of event the gateway publishes: its label map (``LABELS`` in
``static/events.js``) covers `core.events.REGISTRY`."""

from __future__ import annotations

import re
from pathlib import Path

from core.events import REGISTRY

EVENTS_JS = Path(__file__).resolve().parents[2] / "gateway" / "observe" / "dashboard" / "static" / "events.js"


def _labels() -> dict[str, str]:
    """``LABELS``'s entries, read from the script's source (kind: "Label", ...)."""
    block = re.search(r"export const LABELS = \{(.*?)\n\};", EVENTS_JS.read_text(), re.S)
    assert block is not None, "events.js no longer defines `export const LABELS = {...};`"
    return dict(re.findall(r"(\w+): \"([^\"]+)\"", block.group(1)))


def test_the_dashboards_label_map_covers_every_registered_kind() -> None:
    labels = _labels()
    assert sorted(set(REGISTRY) - set(labels)) == []
    assert sorted(set(labels) - set(REGISTRY)) == []  # no label for a kind nothing publishes
    assert labels["failover"] == "Failover" and labels["worker_state"] == "Worker"
