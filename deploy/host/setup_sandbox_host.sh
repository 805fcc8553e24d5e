#!/usr/bin/env bash
# Prepare a Debian 12 host (root, no systemd) for Belayer's Docker + CRIU sandboxes.
#
#   setup_sandbox_host.sh [install]  install what is missing: Docker (Debian's docker.io), debootstrap,
#                                    busybox-static, tmux (Harbor's terminus-2 test), docker-compose (Debian's, for deploy/compose.yaml's
#                                    test), and CRIU >= 4.2 built from Debian's source archive;
#                                    make /etc/criu/runc.conf enable tcp-close and irmap scan paths; run `criu check`
#   setup_sandbox_host.sh check      report what is present and what is missing; change nothing
#   setup_sandbox_host.sh start      start `dockerd --experimental` unless an engine already answers
#   setup_sandbox_host.sh stop       stop dockerd, only if `start` started it (recorded PID)
#   setup_sandbox_host.sh status     say whether an engine answers and who started it
#   setup_sandbox_host.sh dns-leak [VERSION]
#                                    say whether the engine (or Docker VERSION) can leak DNS out of the
#                                    sandboxes' internal network (CVE-2024-29018), and which case applies;
#                                    install, check and start refuse the `leaks` case (below)
#
# CVE-2024-29018: dockerd's DNS server forwards a container's lookups to the host's resolvers from the
# container's namespace (no route out of an internal network), except for resolvers on the host's
# loopback, which it asks from the host's namespace: a sandbox could send data out in DNS names. Moby
# fixed it in 26.0.0, 25.0.5 and 23.0.11; Debian 12's docker.io (20.10.24+dfsg1) does not carry the fix
# (its changelog names no CVE-2024-29018). The cases, the same as sandbox/engine_check.py's:
#   fixed-upstream        the engine's version has the fix
#   fixed-debian          a Debian build whose installed changelog names CVE-2024-29018
#   no-loopback-resolver  no fix, but no resolver of this host is on loopback: nothing leaks (warned)
#   leaks                 no fix, and a resolver on loopback: refused
#
# Idempotent: every step checks first and skips what is already done. A machine that already has
# Docker and CRIU >= 4.2 is used as it is.
#
# Environment (defaults in brackets):
#   BELAYER_STATE_DIR       [/var/lib/belayer]         state root
#   BELAYER_DOCKER_DIR      [$BELAYER_STATE_DIR/docker] dockerd data-root (data/), exec-root (exec/),
#                                                        pidfile, log and the started-by-us PID record
#   BELAYER_DOCKER_SOCKET   [/var/run/docker.sock]     socket that `start` probes and listens on
#   BELAYER_DOCKERD_ARGS    []                         extra dockerd arguments (word-split)
#   BELAYER_DOCKERD_TIMEOUT [30]                       seconds to wait for the engine to answer / exit
#   BELAYER_CACHE_DIR       [/var/cache/belayer]       CRIU source download and build directory
#   CRIU_PREFIX             [/usr/local]               CRIU is installed as $CRIU_PREFIX/sbin/criu
#   CRIU_MIN_VERSION        [4.2]                      older CRIUs fail on kernels >= 6.13 / 6.16
#   DEBIAN_MIRROR           [from debian.sources, else http://deb.debian.org/debian]
#   BELAYER_RESOLV_CONF     [/etc/resolv.conf, or systemd-resolved's list]  the host's resolvers, as dockerd reads them
#   BELAYER_DOCKER_CHANGELOG [/usr/share/doc/docker.io/changelog.Debian.gz]  Debian's docker.io changelog
set -euo pipefail

STATE_DIR=${BELAYER_STATE_DIR:-/var/lib/belayer}
DOCKER_DIR=${BELAYER_DOCKER_DIR:-$STATE_DIR/docker}
DOCKER_SOCKET=${BELAYER_DOCKER_SOCKET:-/var/run/docker.sock}
DOCKERD_TIMEOUT=${BELAYER_DOCKERD_TIMEOUT:-30}
CACHE_DIR=${BELAYER_CACHE_DIR:-/var/cache/belayer}
CRIU_PREFIX=${CRIU_PREFIX:-/usr/local}
CRIU_MIN_VERSION=${CRIU_MIN_VERSION:-4.2}
RECORD="$DOCKER_DIR/started-by-belayer.pid"
DOCKER_CHANGELOG=${BELAYER_DOCKER_CHANGELOG:-/usr/share/doc/docker.io/changelog.Debian.gz}
DNS_CVE=CVE-2024-29018
export DEBIAN_FRONTEND=noninteractive
export PATH="$CRIU_PREFIX/sbin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

CRIU_BUILD_PKGS=(make gcc pkg-config libprotobuf-c-dev protobuf-c-compiler protobuf-compiler libprotobuf-dev
  libnl-3-dev libnet1-dev libcap-dev libbsd-dev libnftables-dev libgnutls28-dev uuid-dev
  python3-protobuf dpkg-dev xz-utils)

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }
now() { echo "${EPOCHREALTIME/,/.}"; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1fs", b - a }'; }
version_ge() { dpkg --compare-versions "$1" ge "$2"; }

# ---------------------------------------------------------------- packages
missing_pkgs() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || echo "$p"
  done
}

APT_UPDATED=0
apt_install() {
  [ "$#" -gt 0 ] || return 0
  local t; t=$(now)
  if [ "$APT_UPDATED" = 0 ]; then
    # Only reached when something is missing. A broken third-party source must not block Debian's.
    apt-get update -qq >/dev/null 2>&1 || say "apt-get update reported errors (continuing with the lists it got)"
    APT_UPDATED=1
  fi
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 || die "apt-get install failed: $*"
  say "apt: installed $# package(s) in $(since "$t"): $*"
}

docker_present() { command -v dockerd >/dev/null 2>&1 || engine_answers; }

install_runtime_pkgs() {
  local want=() missing
  if docker_present; then
    say "docker: found $(dockerd --version 2>/dev/null || echo 'a running engine'), using it as it is"
  else
    want+=(docker.io containerd runc iptables)
  fi
  command -v debootstrap >/dev/null 2>&1 || want+=(debootstrap)
  command -v docker-compose >/dev/null 2>&1 || want+=(docker-compose)  # reads deploy/compose.yaml
  command -v tmux >/dev/null 2>&1 || want+=(tmux)  # Harbor's terminus-2 drives tmux in its sandbox (tests/harness/test_harbor_env.py)
  [ -x /bin/busybox ] && /bin/busybox --list >/dev/null 2>&1 && ldd /bin/busybox 2>&1 | grep -q 'not a dynamic' \
    || want+=(busybox-static)
  mapfile -t missing < <(missing_pkgs "${want[@]}")
  if [ "${#missing[@]}" -eq 0 ]; then say "packages: runtime packages present"; else apt_install "${missing[@]}"; fi
}

# ---------------------------------------------------------------- CRIU
criu_version() {  # prints e.g. 4.2.1 for the given binary, nothing if it does not run
  "$1" --version 2>/dev/null | awk '/^Version:/ { print $2; exit }'
}

working_criu() {  # prints the path of a criu >= CRIU_MIN_VERSION, if any
  local c v
  for c in "$CRIU_PREFIX/sbin/criu" "$(command -v criu 2>/dev/null || true)"; do
    if [ -z "$c" ] || [ ! -x "$c" ]; then continue; fi
    v=$(criu_version "$c")
    if [ -n "$v" ] && version_ge "$v" "$CRIU_MIN_VERSION"; then echo "$c"; return 0; fi
  done
  return 1
}

debian_mirror() {
  if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
  local uri
  uri=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$uri" ] || uri=$(awk '$1 == "deb" && $2 ~ /debian\/?$/ { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

# apt options for a private sid deb-src list that leaves the system's apt configuration untouched.
criu_apt_opts() {
  local d="$CACHE_DIR/criu/apt"
  echo "-o Dir::Etc::SourceList=$d/sources.list -o Dir::Etc::SourceParts=/nonexistent"
  echo "-o Dir::State::Lists=$d/lists -o Dir::Cache=$d/cache"
}

build_criu() {
  local t work apt ver up tarball top bin built
  t=$(now); work="$CACHE_DIR/criu"; apt="$work/apt"
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$work/src"
  echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $(debian_mirror) sid main" \
    >"$apt/sources.list"
  # shellcheck disable=SC2046
  apt-get $(criu_apt_opts) update -qq >/dev/null || die "criu: cannot read Debian's sid source index"
  # The newest CRIU source in the archive; its version is checked below, never pinned here.
  # shellcheck disable=SC2046
  ver=$(apt-cache $(criu_apt_opts) showsrc criu 2>/dev/null | awk '/^Version:/ { print $2 }' \
        | sort -V | tail -1)
  [ -n "$ver" ] || die "criu: no source package found in the sid archive"
  up=${ver#*:}; up=${up%-*}
  version_ge "$up" "$CRIU_MIN_VERSION" || die "criu: archive offers $ver, need >= $CRIU_MIN_VERSION"
  say "criu: building $up from Debian source $ver"
  # The .debian.tar.xz part may 404 on some mirrors; the checksummed upstream orig tarball is all we need.
  # shellcheck disable=SC2046
  (cd "$work/src" && { apt-get $(criu_apt_opts) source --download-only "criu=$ver" >/dev/null 2>&1 || true; })
  tarball=$(compgen -G "$work/src/criu_$up.orig.tar.*" | sed -n 1p || true)
  [ -n "$tarball" ] || die "criu: download of criu_$up.orig.tar.* failed"
  top=$(tar -tf "$tarball" | sed -n '1s|/.*||p')  # sed reads it all: no SIGPIPE under pipefail
  rm -rf "${work:?}/src/$top"
  tar -C "$work/src" -xf "$tarball"
  make -s -C "$work/src/$top" -j"$(nproc)" criu >"$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log" >&2; die "criu: build failed (log: $work/build.log)"; }
  bin="$work/src/$top/criu/criu"
  built=$(criu_version "$bin")
  if [ -z "$built" ] || ! version_ge "$built" "$CRIU_MIN_VERSION"; then
    die "criu: built binary reports '$built'"
  fi
  install -D -m0755 "$bin" "$CRIU_PREFIX/sbin/criu"
  say "criu: built $built in $(since "$t") -> $CRIU_PREFIX/sbin/criu"
}

ensure_criu() {
  local c
  if c=$(working_criu); then
    say "criu: found $(criu_version "$c") at $c, using it"
  else
    local missing
    mapfile -t missing < <(missing_pkgs "${CRIU_BUILD_PKGS[@]}")
    [ "${#missing[@]}" -eq 0 ] || apt_install "${missing[@]}"
    build_criu
    c=$(working_criu) || die "criu: no working criu >= $CRIU_MIN_VERSION after the build"
  fi
  local out
  out=$("$c" check 2>&1) || { printf '%s\n' "$out" >&2; die "criu check failed"; }
  say "criu: check: $(printf '%s' "$out" | tail -1)"
}

ensure_runc_conf() {
  # A restore goes into a *new* container: a new network namespace with a new address, so no TCP
  # connection can be carried over. `tcp-close` dumps connected sockets without freezing them (the live
  # container keeps its connections) and restores them closed: the program sees a reset, as after a
  # network failure, and retries (an agent inside the sandbox re-sends its in-flight LLM call).
  # Without it CRIU refuses to dump a process with a connection; `tcp-established` would instead make
  # every restore with a connection to the gateway fail, because the address is gone.
  local f=/etc/criu/runc.conf
  mkdir -p /etc/criu
  if [ -f "$f" ] && grep -qsx 'tcp-established' "$f"; then
    sed -i '/^tcp-established$/d' "$f"
    say "criu: removed tcp-established from $f (replaced by tcp-close)"
  fi
  # Harnesses (Claude Code, OpenCode) watch their config and project directories with inotify. On
  # overlayfs CRIU cannot reopen a watch by its file handle and falls back to scanning paths ("irmap");
  # these are where a sandbox's harness homes and work trees live. `file-locks`: harnesses keep their
  # state in SQLite (OpenCode), whose POSIX locks CRIU otherwise refuses to dump.
  local line
  for line in 'tcp-close' 'file-locks' 'irmap-scan-path /root' 'irmap-scan-path /home' 'irmap-scan-path /workspace' \
    'irmap-scan-path /tmp'; do
    if grep -qsxF "$line" "$f"; then
      continue
    fi
    echo "$line" >>"$f"
    say "criu: added '$line' to $f"
  done
}

# ---------------------------------------------------------------- CVE-2024-29018: DNS out of internal networks
docker_version() {  # the answering engine's version, else the installed dockerd's; nothing without either
  local v
  v=$(docker_cli version -f '{{.Server.Version}}' 2>/dev/null || true)
  [ -n "$v" ] || v=$(dockerd --version 2>/dev/null | awk '{ print $3 }' | tr -d , || true)
  echo "$v"
}

upstream_fixed() {  # VERSION: Moby 26.0.0 and later, 25.0.5+, 23.0.11+ (24.0 never got the fix)
  local v=${1#v}
  v=${v%%[+~-]*}
  [[ "$v" =~ ^[0-9]+\.[0-9]+ ]] || return 1
  version_ge "$v" 26.0.0 && return 0
  case "$v" in
    25.0.*) version_ge "$v" 25.0.5 ;;
    23.0.*) version_ge "$v" 23.0.11 ;;
    *) return 1 ;;
  esac
}

debian_backport() {  # VERSION: a Debian build whose installed changelog names the CVE
  case "$1" in *dfsg*) ;; *) return 1 ;; esac
  [ -r "$DOCKER_CHANGELOG" ] && zcat -f "$DOCKER_CHANGELOG" | grep -q "$DNS_CVE"
}

resolvers_file() {  # where dockerd reads the host's resolvers
  if [ -n "${BELAYER_RESOLV_CONF:-}" ]; then echo "$BELAYER_RESOLV_CONF"; return; fi
  if [ "$(awk '$1 == "nameserver" { print $2 }' /etc/resolv.conf 2>/dev/null)" = 127.0.0.53 ] \
    && [ -f /run/systemd/resolve/resolv.conf ]; then
    echo /run/systemd/resolve/resolv.conf
  else
    echo /etc/resolv.conf
  fi
}

loopback_resolvers() {  # the host's resolvers on loopback, comma-separated
  awk '$1 == "nameserver" && ($2 ~ /^127\./ || $2 == "::1") { print $2 }' "$(resolvers_file)" 2>/dev/null \
    | paste -sd, -
}

dns_leak_case() {  # VERSION: print "<case>: <why>"; fail in the `leaks` case
  local v=$1 loop
  if upstream_fixed "$v"; then
    echo "fixed-upstream: Docker $v has the fix for $DNS_CVE (DNS leak out of internal networks)"
  elif debian_backport "$v"; then
    echo "fixed-debian: Debian's docker.io $v carries the fix for $DNS_CVE (its changelog names it)"
  else
    loop=$(loopback_resolvers)
    if [ -z "$loop" ]; then
      echo "no-loopback-resolver: Docker $v lacks the fix for $DNS_CVE (DNS leak out of internal networks), but" \
        "no resolver in $(resolvers_file) is on loopback, so dockerd forwards no sandbox's lookup from the" \
        "host: no leak here while it stays so; Docker >= 26.0.0 (25.0.5, 23.0.11) has the fix"
    else
      echo "leaks: Docker $v lacks the fix for $DNS_CVE, and the resolver $loop in $(resolvers_file) is on" \
        "loopback: a sandbox on the gateway network could send data out in DNS lookups. Install Docker" \
        ">= 26.0.0 (or 25.0.5, 23.0.11), or name a resolver that is not on loopback in /etc/resolv.conf"
      return 1
    fi
  fi
}

ensure_no_dns_leak() {  # [VERSION]: say which case applies; die in the `leaks` case
  local v=${1:-$(docker_version)} out
  if [ -z "$v" ]; then say "dns-leak: no Docker engine or dockerd to check"; return 0; fi
  if out=$(dns_leak_case "$v"); then say "dns-leak: $out"; else die "dns-leak: $out"; fi
}

# ---------------------------------------------------------------- dockerd
docker_cli() { docker -H "unix://$DOCKER_SOCKET" "$@"; }
engine_answers() { command -v docker >/dev/null 2>&1 && docker_cli version >/dev/null 2>&1; }

recorded_pid() {  # the PID of the dockerd that `start` launched, if it is still that process
  local pid
  [ -f "$RECORD" ] || return 1
  pid=$(cat "$RECORD")
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  # Guard against PID reuse: it must be a dockerd using our data-root.
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "dockerd.*--data-root $DOCKER_DIR/data" || return 1
  echo "$pid"
}

wait_engine_ready() {
  local pid=$1 deadline
  deadline=$(( $(date +%s) + DOCKERD_TIMEOUT ))
  until engine_answers; do
    kill -0 "$pid" 2>/dev/null || { tail -20 "$DOCKER_DIR/dockerd.log" >&2; die "dockerd exited during start-up"; }
    [ "$(date +%s)" -lt "$deadline" ] || die "dockerd did not answer within ${DOCKERD_TIMEOUT}s (log: $DOCKER_DIR/dockerd.log)"
    sleep 0.1
  done
}

start_dockerd() {
  local t pid extra=()
  if engine_answers; then
    ensure_no_dns_leak
    say "dockerd: an engine already answers on $DOCKER_SOCKET, using it ($(engine_summary))"
    return 0
  fi
  command -v dockerd >/dev/null 2>&1 || die "dockerd: not installed; run '$0 install' first"
  ensure_no_dns_leak
  t=$(now)
  mkdir -p "$DOCKER_DIR/data" "$DOCKER_DIR/exec"
  # shellcheck disable=SC2206
  [ -z "${BELAYER_DOCKERD_ARGS:-}" ] || extra=(${BELAYER_DOCKERD_ARGS})
  # setsid: dockerd must outlive this script and its terminal; its own session keeps signals apart.
  setsid dockerd --experimental -H "unix://$DOCKER_SOCKET" \
    --data-root "$DOCKER_DIR/data" --exec-root "$DOCKER_DIR/exec" --pidfile "$DOCKER_DIR/dockerd.pid" \
    "${extra[@]}" </dev/null >"$DOCKER_DIR/dockerd.log" 2>&1 &
  pid=$!
  echo "$pid" >"$RECORD"
  wait_engine_ready "$pid"
  say "dockerd: ready in $(since "$t"), pid $pid ($(engine_summary))"
}

engine_summary() {
  docker_cli info -f '{{.ServerVersion}} {{.Driver}} cgroup-v{{.CgroupVersion}} experimental={{.ExperimentalBuild}} root={{.DockerRootDir}}' 2>/dev/null
}

stop_dockerd() {
  local pid deadline
  if ! pid=$(recorded_pid); then
    rm -f "$RECORD"
    say "dockerd: not started by this script (no live recorded PID); leaving any engine alone"
    return 0
  fi
  kill -TERM "$pid"
  deadline=$(( $(date +%s) + DOCKERD_TIMEOUT ))
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      say "dockerd: pid $pid ignored SIGTERM for ${DOCKERD_TIMEOUT}s, sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.1
  done
  rm -f "$RECORD"
  say "dockerd: stopped pid $pid"
}

cmd_status() {
  local pid
  if engine_answers; then say "dockerd: answering on $DOCKER_SOCKET ($(engine_summary))"
  else say "dockerd: no engine answers on $DOCKER_SOCKET"; fi
  if pid=$(recorded_pid); then say "dockerd: pid $pid was started by this script"; fi
}

have() {  # LABEL DETAIL-IF-MISSING COMMAND...: report one requirement, return 1 when missing
  local label=$1 hint=$2; shift 2
  if "$@" >/dev/null 2>&1; then say "check: $label ok"; return 0; fi
  say "check: MISSING $label: $hint"; return 1
}

cmd_check() {
  local gaps=0
  have docker "'$0 install' installs Debian's docker.io" docker_present || gaps=1
  have "criu >= $CRIU_MIN_VERSION" "'$0 install' builds it from Debian's source archive" working_criu || gaps=1
  have debootstrap "needed for the python sandbox image (apt-get install debootstrap)" \
    command -v debootstrap || gaps=1
  have busybox "busybox-static provides /bin/busybox" test -x /bin/busybox || gaps=1
  have docker-compose "'$0 install' installs Debian's docker-compose" command -v docker-compose || gaps=1
  have "tcp-close and irmap-scan-path in /etc/criu/runc.conf" "'$0 install' adds them" \
    grep -qsx 'irmap-scan-path /root' /etc/criu/runc.conf || gaps=1
  local v out
  v=$(docker_version)
  if [ -n "$v" ]; then
    if out=$(dns_leak_case "$v"); then say "check: dns-leak $out"; else say "check: REFUSED dns-leak $out"; gaps=1; fi
  fi
  if [ "$gaps" = 0 ]; then say "check: docker $(dockerd --version 2>/dev/null | awk '{print $3}' | tr -d ,), criu $(criu_version "$(working_criu)")"; fi
  return "$gaps"
}

cmd_install() {
  local t; t=$(now)
  [ "$(id -u)" = 0 ] || die "run as root"
  command -v apt-get >/dev/null 2>&1 || die "not a Debian-like host (no apt-get); install Docker and CRIU >= $CRIU_MIN_VERSION yourself"
  install_runtime_pkgs
  ensure_no_dns_leak
  ensure_criu
  ensure_runc_conf
  say "install: done in $(since "$t")"
}

case "${1:-install}" in
  install) cmd_install ;;
  check) cmd_check ;;
  start) start_dockerd ;;
  stop) stop_dockerd ;;
  status) cmd_status ;;
  dns-leak) ensure_no_dns_leak "${2:-}" ;;
  *) echo "usage: $0 [install|check|start|stop|status|dns-leak [VERSION]]" >&2; exit 2 ;;
esac
