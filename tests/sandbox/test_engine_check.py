"""CVE-2024-29018 (DNS out of internal networks): the gateway's check and the set-up script's agree.

No engine is needed: versions, resolver lists and changelogs are given, and the script's
``dns-leak VERSION`` is run with them (``BELAYER_RESOLV_CONF``, ``BELAYER_DOCKER_CHANGELOG``).
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from core.errors import SandboxUnavailable
from sandbox.engine_check import check_engine, dns_leak_verdict, upstream_fixed, version_tuple
from tests.sandbox.conftest import SETUP

FIXED = ["26.0.0", "26.1.5+dfsg1", "v27.3.1", "28.2.2", "25.0.5", "25.0.8", "23.0.11", "23.0.15"]
UNFIXED = [
    "25.0.4",
    "25.0.0",
    "24.0.9",
    "24.0.0",
    "23.0.10",
    "20.10.24+dfsg1",
    "20.10.24",
    "19.03.15",
    "junk",
]


def script(version: str, resolv: Path, changelog: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BELAYER_RESOLV_CONF": str(resolv), "BELAYER_DOCKER_CHANGELOG": str(changelog)}
    return subprocess.run(
        [str(SETUP), "dns-leak", version], capture_output=True, text=True, env=env, timeout=30, check=False
    )


def script_case(done: subprocess.CompletedProcess[str]) -> str:
    line = (done.stdout + done.stderr).strip().splitlines()[-1]
    return line.split("dns-leak: ", 1)[1].split(":", 1)[0]


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    """Resolver lists (on loopback, not) and Debian changelogs (with the CVE, without)."""
    files = {"loopback": tmp_path / "loopback.conf", "remote": tmp_path / "remote.conf"}
    files["loopback"].write_text("search example\nnameserver 127.0.0.1\nnameserver 10.0.0.2\n")
    files["remote"].write_text("nameserver 10.255.255.53\n")
    for name, text in (("patched", "  * Fix CVE-2024-29018: DNS from internal networks\n"), ("plain", "")):
        with gzip.open(tmp_path / f"{name}.gz", "wt") as f:
            f.write(f"docker.io (20.10.24+dfsg1-1+deb12u2) bookworm; urgency=medium\n\n{text}")
        files[name] = tmp_path / f"{name}.gz"
    return files


@pytest.mark.parametrize("version", FIXED + UNFIXED)
def test_script_and_gateway_decide_alike(version: str, host: dict[str, Path]) -> None:
    assert upstream_fixed(version) == (version in FIXED)
    for resolv, changelog in (("loopback", "plain"), ("remote", "plain"), ("loopback", "patched")):
        verdict = dns_leak_verdict(version, changelog=host[changelog], resolv_conf=host[resolv])
        done = script(version, host[resolv], host[changelog])
        assert (script_case(done), done.returncode) == (verdict.case, 1 if verdict.refused else 0), done
    cases = {
        (resolv, changelog): dns_leak_verdict(
            version, changelog=host[changelog], resolv_conf=host[resolv]
        ).case
        for resolv, changelog in (("loopback", "plain"), ("remote", "plain"), ("loopback", "patched"))
    }
    if version in FIXED:
        assert set(cases.values()) == {"fixed-upstream"}
    else:
        assert cases[("loopback", "plain")] == "leaks"
        assert cases[("remote", "plain")] == "no-loopback-resolver"
        # only a Debian build (+dfsg) is vouched for by Debian's changelog
        assert cases[("loopback", "patched")] == ("fixed-debian" if "dfsg" in version else "leaks")


def test_the_gateway_refuses_an_engine_that_leaks(host: dict[str, Path]) -> None:
    class Engine:  # what check_engine asks of docker's APIClient
        def __init__(self, version: str) -> None:
            self.answer = {"Version": version}

        def version(self) -> dict[str, str]:
            return self.answer

    with pytest.raises(SandboxUnavailable, match=r"lacks the fix for CVE-2024-29018.*127\.0\.0\.1.*26\.0\.0"):
        check_engine(Engine("20.10.24+dfsg1"), changelog=host["plain"], resolv_conf=host["loopback"])
    ok = check_engine(Engine("20.10.24+dfsg1"), changelog=host["plain"], resolv_conf=host["remote"])
    assert ok.case == "no-loopback-resolver"
    assert check_engine(Engine("26.1.5+dfsg1"), resolv_conf=host["loopback"]).case == "fixed-upstream"
    assert version_tuple("20.10.24+dfsg1") == (20, 10, 24)


def test_the_set_up_says_which_case_applies_on_this_machine() -> None:
    """Run as the set-up runs it: the engine's (or the installed dockerd's) version, this host's files."""
    done = subprocess.run([str(SETUP), "dns-leak"], capture_output=True, text=True, timeout=60, check=False)
    out = (done.stdout + done.stderr).strip()
    if shutil.which("dockerd") is None and "no Docker engine or dockerd" in out:
        assert done.returncode == 0
        return
    version = subprocess.run(["dockerd", "--version"], capture_output=True, text=True, check=True).stdout
    verdict = dns_leak_verdict(version.split()[2].rstrip(","))
    assert (script_case(done), done.returncode) == (verdict.case, 1 if verdict.refused else 0), out
    print(out)  # the case, in the test's output (pytest -rP)
