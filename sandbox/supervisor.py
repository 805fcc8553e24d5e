"""The in-container half of a sandbox: a PID-1 supervisor and the per-call exec client.

CRIU only captures PID 1 and its descendants; processes started by `docker exec` are killed at
checkpoint. So PID 1 is a small supervisor (busybox sh) that spawns and owns the agent's persistent
shells. Each `exec` is a short-lived `docker exec` of the client, which feeds one request to a session
shell through that shell's stdin FIFO, waits for it (killing it on timeout) and prints the result.

Layout inside the container (all under `/.belayer`, part of the snapshot like any file)::

    bin/busybox            static busybox copied from the host; both scripts run under it
    supervisor.sh          PID 1: `busybox sh supervisor.sh WORKDIR`
    client.sh              `busybox sh client.sh SESSION SHELL WORKDIR TIMEOUT_CS MAX_BYTES SCRIPT`
    ctl                    FIFO the supervisor reads `spawn SESSION SHELL DIR` lines from
    s/SESSION/in           FIFO that is the session shell's stdin (opened read-write: never EOF)
    s/SESSION/pid          the session shell's PID (its own session and process group)
    s/SESSION/state.*      cwd and exported env after the last command: a respawned shell resumes there
    s/SESSION/r/           the current request: cmd.sh, out, err, status, done
    s/SESSION/bg/          out/err of requests whose background jobs still run (kept: see finish)

The client's result is the command's bounded stdout and stderr, then a trailer line on stderr:
`<RS>BELAYER rc=N timeout=0|1 out=BYTES err=BYTES fresh=0|1` (RS is the ASCII record separator).
"""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

ROOT = "/.belayer"
BUSYBOX = f"{ROOT}/bin/busybox"
SUPERVISOR = f"{ROOT}/supervisor.sh"
CLIENT = f"{ROOT}/client.sh"
LARGE_SCRIPT = "@"
"""Passed instead of the script when the host uploaded it to `large_script_path(session)`."""
TRAILER = "\n\x1eBELAYER "

SUPERVISOR_SH = r"""# Belayer PID-1 supervisor (busybox sh). Owns the session shells so that CRIU captures them.
B=/.belayer
BB=$B/bin/busybox
"$BB" mkdir -p "$1" "$B/s"
[ -p "$B/ctl" ] || "$BB" mkfifo "$B/ctl"
exec 3<>"$B/ctl" </dev/null >/dev/null 2>&1

spawn() {  # SESSION SHELL DIR
	d=$B/s/$1
	"$BB" mkdir -p "$d/r"
	[ -p "$d/in" ] || "$BB" mkfifo "$d/in"
	"$BB" rm -f "$d/pid"
	# setsid: the shell leads its own process group, so a timeout can find the command's processes.
	( cd "$3" 2>/dev/null || cd /; exec "$BB" setsid "$2" 0<>"$d/in" >"$d/log" 2>&1 ) &
	echo $! >"$d/pid.new" && "$BB" mv "$d/pid.new" "$d/pid"
}

while :; do
	if read -r -t 5 cmd name shell dir <&3; then
		case $cmd in
			spawn) spawn "$name" "$shell" "$dir" ;;
		esac
	fi
	# Waiting for any forked child makes ash waitpid(-1): that reaps orphans re-parented to PID 1.
	"$BB" true
done
"""

CLIENT_SH = r"""# Belayer exec client (busybox sh), run by `docker exec` for one request.
B=/.belayer
BB=$B/bin/busybox
session=$1 shell=$2 workdir=$3 timeout_cs=$4 max=$5 script=$6
d=$B/s/$session
r=$d/r

now() { read -r up _ </proc/uptime; NOW=$(( ${up%.*} * 100 + 1${up#*.} - 100 )); }

stat_of() {  # PID -> STATE, PG (process group), ST (start time in ticks); fails if gone
	read -r line <"/proc/$1/stat" 2>/dev/null || return 1
	set -- ${line##*) }
	STATE=$1 PG=$3
	eval "ST=\${20}"
}

alive() {  # the session shell exists and is not a zombie; sets SPID
	[ -s "$d/pid" ] && read -r SPID <"$d/pid" && stat_of "$SPID" && [ "$STATE" != Z ]
}

kill_since() {  # kill the session's processes that started at or after tick $1, except the shell
	for p in /proc/[0-9]*; do
		p=${p#/proc/}
		if [ "$p" = "$SPID" ] || [ "$p" = "$$" ]; then continue; fi
		stat_of "$p" || continue
		if [ "$PG" = "$SPID" ] && [ "$ST" -ge "$1" ]; then kill -9 "$p" 2>/dev/null; fi
	done
}

started_since() {  # a live process of the session's group, other than the shell, started at tick >= $1
	for p in /proc/[0-9]*; do
		p=${p#/proc/}
		if [ "$p" = "$SPID" ]; then continue; fi
		stat_of "$p" || continue
		if [ "$PG" = "$SPID" ] && [ "$ST" -ge "$1" ] && [ "$STATE" != Z ]; then return 0; fi
	done
	return 1
}

finish() {  # RC TIMED_OUT FRESH
	"$BB" head -c "$max" "$r/out" 2>/dev/null
	"$BB" head -c "$max" "$r/err" 1>&2 2>/dev/null
	o=$("$BB" stat -c %s "$r/out" 2>/dev/null || echo 0)
	e=$("$BB" stat -c %s "$r/err" 2>/dev/null || echo 0)
	# Background jobs of this request still write to out/err. Keep those files linked (under bg/):
	# deleted-but-open files become CRIU "ghost files", and a dump refuses ghosts over 1 MB.
	if [ -n "$since" ] && alive && started_since "$since"; then
		"$BB" mkdir -p "$d/bg"
		"$BB" mv "$r/out" "$d/bg/$since.out"
		"$BB" mv "$r/err" "$d/bg/$since.err"
	fi
	printf '\n\036BELAYER rc=%s timeout=%s out=%s err=%s fresh=%s\n' "$1" "$2" "$o" "$e" "$3" >&2
	exit 0
}

start_session() {
	"$BB" rm -f "$d/pid"
	echo "spawn $session $shell $workdir" >"$B/ctl"
	now; limit=$((NOW + 1000))
	until alive; do
		now; [ "$NOW" -lt "$limit" ] || { echo "belayer: session $session did not start" >&2; exit 70; }
		"$BB" usleep 5000
	done
}

fresh=0 since=
if ! alive; then start_session; fresh=1; fi
"$BB" mkdir -p "$r"
"$BB" rm -f "$r/out" "$r/err" "$r/status" "$r/done"
if [ "$script" = @ ]; then "$BB" mv "$B/$session.in" "$r/cmd.sh"; else printf '%s\n' "$script" >"$r/cmd.sh"; fi
if ! "$shell" -n "$r/cmd.sh" 2>"$r/err"; then : >"$r/out"; finish 2 0 "$fresh"; fi

resume=
if [ "$fresh" = 1 ] && [ -f "$d/state.cwd" ]; then
	# A respawned session resumes in the last cwd with the last exported environment.
	resume=". $d/state.env 2>/dev/null; read -r __belayer_cwd <$d/state.cwd; cd -- \"\$__belayer_cwd\"; unset __belayer_cwd;"
fi
stat_of $$; since=$ST
now; deadline=$((NOW + timeout_cs))
printf '%s\n' "$resume trap 'echo \$? >$r/status; : >$r/done' EXIT; . $r/cmd.sh >$r/out 2>$r/err </dev/null; echo \$? >$r/status; trap - EXIT; pwd >$d/state.cwd; export -p >$d/state.env; : >$r/done" >"$d/in"

timed_out=0
while [ ! -e "$r/done" ] && alive; do
	now; if [ "$NOW" -ge "$deadline" ]; then timed_out=1; break; fi
	"$BB" usleep 10000
done

if [ "$timed_out" = 1 ]; then
	kill_since "$since"
	# Give the shell a second to get through the rest of the script, killing whatever it starts;
	# a shell still busy then (a builtin loop) is killed too and respawned on the next call.
	now; grace=$((NOW + 100))
	while [ ! -e "$r/done" ] && alive; do
		now; [ "$NOW" -lt "$grace" ] || break
		"$BB" usleep 20000
		kill_since "$since"
	done
	if [ ! -e "$r/done" ] && alive; then kill -9 "$SPID"; kill_since "$since"; fi
	finish 137 1 "$fresh"
fi
rc=255
[ -s "$r/status" ] && read -r rc <"$r/status"
finish "$rc" 0 "$fresh"
"""


def large_script_path(session: str) -> str:
    """Where the host uploads a script too long for one argv element."""
    return f"{ROOT}/{session}.in"


def bundle_tar(busybox: Path) -> bytes:
    """A tar (to extract at `/`) holding busybox and the two scripts under `/.belayer`."""
    buf = io.BytesIO()
    mtime = time.time()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in (".belayer", ".belayer/bin", ".belayer/s"):
            _add_dir(tar, name, mtime)
        tar.add(str(busybox), arcname=".belayer/bin/busybox", filter=_root_owned)
        _add_file(tar, ".belayer/supervisor.sh", SUPERVISOR_SH.encode(), mtime)
        _add_file(tar, ".belayer/client.sh", CLIENT_SH.encode(), mtime)
    return buf.getvalue()


def _root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _add_dir(tar: tarfile.TarFile, name: str, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = 0o755
    info.mtime = int(mtime)
    tar.addfile(info)


def _add_file(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o755
    info.mtime = int(mtime)
    tar.addfile(info, io.BytesIO(data))
