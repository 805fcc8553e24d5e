"""Whether the Docker engine can leak DNS out of the gateway network (CVE-2024-29018).

Docker's embedded DNS server answers the containers of a user-defined network and forwards other
names to the host's resolvers. It does so from the container's network namespace (where an internal
network has no route out), except for resolvers on the host's loopback (127.0.0.0/8; ::1 is counted
too): those it asks
from the host's namespace, so a container on an internal network could still send data out, encoded
in the names it looks up. Moby fixed it in 26.0.0, 25.0.5 and 23.0.11 (24.0 never got the fix).
Debian's bookworm ``docker.io`` (20.10.24+dfsg1) does not carry the fix: its changelog names no
CVE-2024-29018.

`dns_leak_verdict` says which case applies, the same four as ``deploy/host/setup_sandbox_host.sh
dns-leak``:

============================ ==========================================================================
``fixed-upstream``           the engine's version has Moby's fix
``fixed-debian``             a Debian build whose installed changelog names CVE-2024-29018
``no-loopback-resolver``     not fixed, but none of the host's resolvers is on loopback: nothing is
                             forwarded from the host's namespace, so nothing leaks (warned)
``leaks``                    not fixed, and a resolver is on loopback: refused
============================ ==========================================================================

Example::

    verdict = check_engine(api)      # logs the case; SandboxUnavailable when it leaks

>>> upstream_fixed("26.1.5+dfsg1"), upstream_fixed("25.0.4"), upstream_fixed("23.0.11")
(True, False, True)
"""

from __future__ import annotations

import gzip
import ipaddress
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from core.errors import SandboxUnavailable

log = logging.getLogger("belayer.sandbox")

CVE = "CVE-2024-29018"
DEBIAN_CHANGELOG = Path("/usr/share/doc/docker.io/changelog.Debian.gz")
RESOLV_CONF = Path("/etc/resolv.conf")
SYSTEMD_RESOLV_CONF = Path("/run/systemd/resolve/resolv.conf")
"""Where dockerd reads the upstream resolvers when /etc/resolv.conf names only systemd-resolved's stub."""
_FIXED = ((26, 0, 0), (25, 0, 5), (23, 0, 11))
"""The first release with the fix, per release line; a line not listed here (24) never got it."""
Case = Literal["fixed-upstream", "fixed-debian", "no-loopback-resolver", "leaks"]


@dataclass(frozen=True, slots=True)
class DnsLeakVerdict:
    case: Case
    detail: str

    @property
    def refused(self) -> bool:
        return self.case == "leaks"


def version_tuple(version: str) -> tuple[int, int, int] | None:
    """``20.10.24+dfsg1`` -> (20, 10, 24); None for what is not a release number."""
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def upstream_fixed(version: str) -> bool:
    """Whether Moby `version` has the fix (26.0.0 and later, 25.0.5+, 23.0.11+)."""
    v = version_tuple(version)
    if v is None:
        return False
    if v >= _FIXED[0]:
        return True
    return any(v[:2] == fixed[:2] and v >= fixed for fixed in _FIXED[1:])


def debian_backport(version: str, changelog: Path = DEBIAN_CHANGELOG) -> bool:
    """Whether `version` is a Debian build (``+dfsg``) and the installed package's changelog names the CVE."""
    if "dfsg" not in version:
        return False
    try:
        with gzip.open(changelog, "rt", errors="replace") as f:
            return CVE in f.read()
    except OSError:
        return False


def loopback_resolvers(resolv_conf: Path | None = None) -> list[str]:
    """The host's resolvers that dockerd would ask from the host's namespace (on loopback), read
    as dockerd does: /etc/resolv.conf, or systemd-resolved's list when that names only its stub."""
    if resolv_conf is None:
        resolv_conf = RESOLV_CONF
        if _nameservers(RESOLV_CONF) == ["127.0.0.53"] and SYSTEMD_RESOLV_CONF.exists():
            resolv_conf = SYSTEMD_RESOLV_CONF
    return [ip for ip in _nameservers(resolv_conf) if _loopback(ip)]


def dns_leak_verdict(
    version: str, *, changelog: Path = DEBIAN_CHANGELOG, resolv_conf: Path | None = None
) -> DnsLeakVerdict:
    """Which case of the module's table applies to an engine of `version` on this host."""
    if upstream_fixed(version):
        return DnsLeakVerdict("fixed-upstream", f"Docker {version} has the fix for {CVE} (DNS leak)")
    if debian_backport(version, changelog):
        return DnsLeakVerdict("fixed-debian", f"Debian's docker.io {version} carries the fix for {CVE}")
    loopback = loopback_resolvers(resolv_conf)
    if not loopback:
        return DnsLeakVerdict(
            "no-loopback-resolver",
            f"Docker {version} lacks the fix for {CVE} (DNS leak out of internal networks), but no resolver "
            "of this host is on loopback, so dockerd forwards no sandbox's lookup from the host: no leak "
            "here while it stays so; Docker >= 26.0.0 (25.0.5, 23.0.11) has the fix",
        )
    return DnsLeakVerdict(
        "leaks",
        f"Docker {version} lacks the fix for {CVE}, and this host's resolver {', '.join(loopback)} is on "
        "loopback: a sandbox on the gateway network could send data out in DNS lookups. Install Docker >= "
        "26.0.0 (or 25.0.5, 23.0.11), or name a resolver that is not on loopback in /etc/resolv.conf",
    )


def check_engine(
    api: Any, *, changelog: Path = DEBIAN_CHANGELOG, resolv_conf: Path | None = None
) -> DnsLeakVerdict:
    """Check the engine behind `api` (a docker ``APIClient``, on this host); log which case applies, and
    raise `SandboxUnavailable` when its gateway network could leak."""
    version = str(api.version().get("Version", ""))
    verdict = dns_leak_verdict(version, changelog=changelog, resolv_conf=resolv_conf)
    if verdict.refused:
        raise SandboxUnavailable(verdict.detail)
    if verdict.case == "no-loopback-resolver":
        log.warning("docker engine: %s", verdict.detail)
    else:
        log.info("docker engine: %s", verdict.detail)
    return verdict


def _nameservers(path: Path) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [f[1] for f in (line.split() for line in lines) if len(f) >= 2 and f[0] == "nameserver"]


def _loopback(ip: str) -> bool:
    try:
        address = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return False
    return address.is_loopback  # ::1 too: dockerd may treat it alike, and counting it errs on the safe side
