"""``belayer export`` and ``belayer store prune``: trajectories out of a store for a trainer, and old
closed sessions out of it; with the durations and times their flags take (`since_timestamp`, `older_than`)."""

from __future__ import annotations

import argparse

from core.errors import ConfigError, NotFound

DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def since_timestamp(text: str, now: float) -> float:
    """``--since``: a duration back from `now` (``90m``, ``2h``, ``7d``, ``1w``) or an ISO date or
    datetime (local time unless it names its zone), as a Unix timestamp.

    >>> since_timestamp("2h", now=10_000.0)
    2800.0
    >>> since_timestamp("1970-01-02T00:00:00+00:00", now=0.0)
    86400.0
    """
    from datetime import datetime

    unit = DURATION_UNITS.get(text[-1:])
    if unit is not None:
        try:
            amount = float(text[:-1])
        except ValueError:
            amount = -1.0
        if amount >= 0 and amount != float("inf"):
            return now - amount * unit
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ConfigError(
            f"--since {text}: not a time; give a duration back from now (30m, 2h, 7d, 1w) "
            "or an ISO date or datetime (2026-01-31, 2026-01-31T12:00:00Z)"
        ) from None


def store_default() -> str:
    """Where ``belayer serve`` writes its store when not told (``--store``): the same for export and prune."""
    from belayer.cli.serve import setting_field

    return str(setting_field("store_path").default)


STORE_HELP = (
    "the trajectory store `belayer serve` wrote: its --store, a SQLite file (relative to the directory it "
    "ran in) or a postgresql:// URL (default: %(default)s, serve's default)"
)


def check_store(store: str) -> None:
    """A store file that is not there is an error that says where serve writes one (opening it would
    create an empty store, and the export would silently hold nothing)."""
    from pathlib import Path

    from store.factory import is_url

    if is_url(store) or Path(store).is_file():
        return
    where = "" if Path(store).is_absolute() else f" in {Path.cwd()}"
    raise ConfigError(
        f"--store {store}: no such file{where}; give the store `belayer serve` wrote: its --store, by "
        f"default {store_default()} in the directory it ran in"
    )


def run_export(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from store import SessionQuery
    from store.export import export
    from store.factory import open_store

    check_store(args.store)
    if args.format == "atif" and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(
            f"--out {args.out}: is a file; --format atif writes a directory (one trajectory.json per "
            "branch), e.g. --out atif/"
        )
    if args.format != "atif" and Path(args.out).is_dir():
        example = Path(args.out) / f"rollouts.{args.format}"
        raise ConfigError(f"--out {args.out}: is a directory; give a file to write, e.g. --out {example}")
    since = since_timestamp(args.since, time.time()) if args.since is not None else None
    query = None
    if args.status is not None or args.rewarded_only or since is not None:
        query = SessionQuery(
            status=args.status, has_reward=True if args.rewarded_only else None, created_after=since
        )
    store = open_store(args.store)
    try:
        n = export(store, args.out, args.format, args.session or None, query)
    except NotFound as exc:
        raise ConfigError(f"--session: {exc}") from None
    finally:
        store.close()
    print(f"exported {n} trajectories to {args.out}")
    return 0


def older_than(text: str) -> float:
    """``--older-than``: a duration (``90s``, ``30m``, ``12h``, ``7d``) in seconds."""
    unit = DURATION_UNITS.get(text[-1:])
    try:
        amount = float(text[:-1]) if unit is not None else -1.0
    except ValueError:
        amount = -1.0
    if unit is None or not 0 <= amount < float("inf"):
        raise ConfigError(f"--older-than {text}: not a duration; give a number and a unit: 90s, 30m, 12h, 7d")
    return amount * unit


def run_prune(args: argparse.Namespace) -> int:
    import time
    from datetime import datetime

    from store.factory import open_store

    check_store(args.store)
    cutoff = time.time() - older_than(args.older_than)
    store = open_store(args.store, recover=False)  # a gateway may be running on it: leave its turns be
    try:
        before = store.size_bytes()
        pruned = store.prune(cutoff, exported_only=args.exported_only)
        store.vacuum()
        after = store.size_bytes()
    finally:
        store.close()
    which = "exported sessions" if args.exported_only else "sessions"
    when = datetime.fromtimestamp(cutoff).isoformat(timespec="seconds")
    shown = ", ".join(pruned[:20]) + (f" and {len(pruned) - 20} more" if len(pruned) > 20 else "")
    print(f"pruned {len(pruned)} {which} closed before {when}" + (f": {shown}" if pruned else ""))
    print(f"store {args.store}: {before} -> {after} bytes")
    return 0
