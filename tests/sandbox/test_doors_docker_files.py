"""The Docker backend's file reads on a real engine (issue 31, finding 6): the size from the archive's stat
header before any byte, and at most one symbolic link, in a bounded number of engine calls.

Every request the backend sends the engine is recorded (a `requests` response hook on its API client):
a sparse 50 GB file is refused after a ``HEAD`` of its archive alone, and a loop of links after at most
two requests, where the backend used to recurse until Python's recursion limit (~1,000 calls, a 500).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests

from core.errors import SandboxFileTooLarge, SandboxPathRefused
from sandbox.backend import Sandbox
from sandbox.docker_backend import DockerSandboxBackend

pytestmark = pytest.mark.docker


@pytest.fixture
def archive_calls(backend: DockerSandboxBackend) -> Iterator[list[str]]:
    """The methods of the engine's ``/archive`` requests made during the test, in order."""
    seen: list[str] = []

    def hook(response: requests.Response, *args: Any, **kwargs: Any) -> None:
        if "/archive" in str(response.request.path_url):
            seen.append(str(response.request.method))

    hooks = backend._api.hooks["response"]
    hooks.append(hook)
    yield seen
    hooks.remove(hook)


def test_a_sparse_50_gb_file_is_refused_from_its_stat_header_alone(
    backend: DockerSandboxBackend, box: Sandbox, archive_calls: list[str]
) -> None:
    assert (
        backend.exec(box.id, "truncate -s 50G /workspace/sparse && echo 1234 > /workspace/small").exit_code
        == 0
    )
    with pytest.raises(SandboxFileTooLarge, match="holds 53687091200 bytes, over the 16777216"):
        backend.read_file(box.id, "sparse", max_bytes=16 << 20)
    assert archive_calls == ["HEAD"]  # the header only: no body was asked for

    archive_calls.clear()
    assert backend.read_file(box.id, "small", max_bytes=5) == b"1234\n"
    assert archive_calls == ["HEAD", "GET"]
    archive_calls.clear()
    with pytest.raises(SandboxFileTooLarge):
        backend.read_file(box.id, "small", max_bytes=4)
    assert archive_calls == ["HEAD"]


def test_one_link_is_followed_and_a_second_or_a_loop_is_refused_in_few_calls(
    backend: DockerSandboxBackend, box: Sandbox, archive_calls: list[str]
) -> None:
    script = (
        "cd /workspace && echo real > real.txt && ln -s real.txt one && ln -s one two "
        "&& ln -s loop-b loop-a && ln -s loop-a loop-b && ln -s self self && mkdir dir"
    )
    assert backend.exec(box.id, script).exit_code == 0
    assert backend.read_file(box.id, "one") == b"real\n"
    assert archive_calls == ["HEAD", "GET", "HEAD", "GET"]  # stat, the link itself, stat, the bytes
    for path in ("two", "loop-a", "self"):
        archive_calls.clear()
        with pytest.raises(SandboxPathRefused, match="more than one symbolic link"):
            backend.read_file(box.id, path)
        assert len(archive_calls) <= 4, (path, archive_calls)
    with pytest.raises(SandboxPathRefused, match="is a directory"):
        backend.read_file(box.id, "dir")
    backend.write_file(box.id, "one", b"new\n")  # a write replaces the link, never writes through it
    assert backend.exec(box.id, "cat /workspace/real.txt /workspace/one").stdout == "real\nnew\n"
