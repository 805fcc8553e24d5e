"""The documentation's code runs as written: the snippets a new user copies first, and the export
page's conversions to verl's batch and slime's `Sample`.

A fenced block of docs/getting-started.md, docs/client.md or docs/export.md that follows the line
``<!-- docs-test: run -->`` (an HTML comment: the site does not show it) is run as it stands, pages and
blocks in order (later blocks' outputs count the sessions of earlier ones, as for a reader who runs
them all), against one ``belayer serve --worker-kind fake`` started as the getting-started page says,
in a fresh directory that every block runs in too (so the store is serve's default
``belayer-trajectories.db`` there). Only the gateway's address is rewritten (the docs say
``127.0.0.1:8000``). A block after ``<!-- docs-test: prints -->`` is what the run block before it must
print, exactly. Mark a new block runnable, say what it prints, and update the count below.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from belayer.cli import main as cli
from core.net import free_port
from engine_pool.fake import TOKEN_DELAY_ENV
from tests.gateway.test_export import episode, open_session
from tests.support import REPO, GatewayHarness, log_tail, stop, wait_healthy

DOCS = REPO / "docs"
RUNNABLE = ("getting-started.md", "client.md", "export.md")
RUN, PRINTS = "<!-- docs-test: run -->", "<!-- docs-test: prints -->"
FENCE = re.compile(r"^(<!-- docs-test: \w+ -->\n)?```(\w*)[^\n]*\n(.*?)^```$", re.S | re.M)
DOCS_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True, slots=True)
class Snippet:
    where: str  # page:line
    lang: str
    code: str
    prints: str | None


def snippets(page: str) -> list[Snippet]:
    """The page's runnable blocks, each with the output the page says it prints (None: not said)."""
    text = (DOCS / page).read_text()
    found: list[Snippet] = []
    for m in FENCE.finditer(text):
        marker, lang, body = (m[1] or "").strip(), m[2], m[3]
        where = f"{page}:{text.count(chr(10), 0, m.start()) + 1}"
        if marker == RUN:
            assert lang in ("python", "bash"), f"{where}: a runnable block is python or bash, not {lang!r}"
            found.append(Snippet(where, lang, body, None))
        elif marker == PRINTS:
            assert found and found[-1].prints is None, f"{where}: no run block before this output"
            found[-1] = Snippet(found[-1].where, found[-1].lang, found[-1].code, body)
    return found


def run_snippet(snippet: Snippet, url: str, cwd: Path, env: dict[str, str]) -> str:
    """Run one block as a user would paste it, in `cwd`; returns what it printed. Python runs in this
    process (its imports are this test run's already: seconds saved per block) as a script of its own
    (``__main__``, a fresh namespace); bash in a shell whose ``belayer`` is this environment's."""
    code = snippet.code.replace(DOCS_URL, url)
    if snippet.lang == "python":
        out = io.StringIO()
        here = os.getcwd()
        os.chdir(cwd)
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, snippet.where, "exec"), {"__name__": "__main__"})
        finally:
            os.chdir(here)
        return out.getvalue()
    path = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    argv = ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(
        argv, cwd=cwd, env={**env, "PATH": path}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"{snippet.where} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
    return done.stdout


def documented_gateway() -> list[str]:
    """The fake-worker gateway getting-started.md starts, as its command line (``belayer`` as this
    interpreter runs it)."""
    line = re.search(
        r"^belayer (serve [^#\n]*--worker-kind fake[^#\n]*)", (DOCS / RUNNABLE[0]).read_text(), re.M
    )
    assert line, "getting-started.md no longer shows the fake-worker gateway its snippets run against"
    return [sys.executable, "-m", "belayer.cli", *shlex.split(line[1])]


def test_the_pages_runnable_snippets_run_as_written(tiny_model_dir: Path, tmp_path: Path) -> None:
    found = {page: snippets(page) for page in RUNNABLE}
    assert {page: len(s) for page, s in found.items()} == {
        "getting-started.md": 1,
        "client.md": 4,
        "export.md": 1,
    }
    assert all(s.prints is not None for page in found.values() for s in page)  # each says what it prints
    argv = documented_gateway()
    assert argv[3:6] == ["serve", "--model", ".cache/tiny-model"]
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "tiny-model").symlink_to(tiny_model_dir)  # as in the source checkout
    port, log = free_port(), tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BELAYER_")}  # a developer's settings
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [*argv, "--port", str(port)], cwd=tmp_path, env={**env, TOKEN_DELAY_ENV: "0"},
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(f"{url}/health", [proc], 60, log)
        for page in RUNNABLE:
            for snippet in found[page]:
                printed = run_snippet(snippet, url, tmp_path, env)
                assert printed == snippet.prints, f"{snippet.where} printed:\n{printed}{log_tail(log)}"
    finally:
        stop(proc)
    assert (tmp_path / "belayer-trajectories.db").is_file()  # the store the export snippet named


# --- export.md's conversions, on a real export ---------------------------------------------------------


def example() -> dict[str, Any]:
    text = (DOCS / "export.md").read_text()
    section = text[text.index("### Example: rows to verl's batch") :]
    [code] = re.findall(r"```python\n(.*?)```", section, re.S)[:1]
    namespace: dict[str, Any] = {}
    exec(compile(code, str(DOCS / "export.md"), "exec"), namespace)  # the document's own example
    return namespace


async def test_the_documented_conversions_run_on_an_export(gateway: GatewayHarness, tmp_path: Path) -> None:
    await episode(gateway)
    await open_session(gateway)
    out = tmp_path / "rollouts.parquet"
    argv = ["export", "--store", gateway.gw.config.store_path, "--format", "parquet", "--out", str(out)]
    assert cli(argv) == 0
    rows = pq.read_table(out).to_pylist()
    ns = example()
    pad = gateway.gw.tokenizer.encode(gateway.gw.tokenizer.eos_token)[0]
    plen = max(len(r["prompt_ids"]) for r in rows)
    rlen = max(len(r["response_ids"]) for r in rows)
    batch = ns["to_verl_batch"](rows, pad, plen, rlen)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (len(rows), plen + rlen)
    for i, row in enumerate(rows):
        real = batch["input_ids"][i][batch["attention_mask"][i] == 1].tolist()
        assert real == row["prompt_ids"] + row["response_ids"]
        n = len(row["response_ids"])
        assert batch["response_mask"][i, :n].tolist() == row["response_mask"]
        assert not batch["response_mask"][i, n:].any() and not batch["rollout_log_probs"][i, n:].any()
        assert np.allclose(batch["rollout_log_probs"][i, :n], row["response_logprobs"])
        assert batch["token_level_scores"][i].sum() == (row["reward"] or 0.0)
        positions = batch["position_ids"][i][batch["attention_mask"][i] == 1].tolist()
        assert positions == list(range(len(real)))  # from 0 at the first real token, padding aside

        sample = ns["to_slime_sample"](row)
        # slime's own checks: loss mask and logprobs cover the response exactly
        assert len(sample["loss_mask"]) == len(sample["rollout_log_probs"]) == sample["response_length"] == n
        assert sample["tokens"][-n:] == row["response_ids"] and sample["status"] == "completed"
    assert [ns["to_slime_sample"](r)["reward"] for r in rows] == [1.0, 1.0, 1.0, None]
