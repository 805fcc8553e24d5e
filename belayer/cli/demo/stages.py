"""The demo's stages against a running gateway (`show`): the episode with its worker killed mid-answer,
the failover as the trajectory records it, the same episode undisturbed for comparison, the shadow's
promotion and its replacement, and with ``--kills N`` the killed episode again."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import httpx

from belayer.cli.demo.episode import Episode, Killer, new_session
from belayer.cli.demo.findings import (
    DemoFailed,
    Findings,
    Json,
    cold_start_s,
    failover_event,
    say,
    timeline_worker,
    token_mismatches,
)
from belayer.cli.demo.processes import GatewayRun


def _wait_for(gw: GatewayRun, what: str, done: Callable[[list[Json]], bool], timeout: float) -> list[Json]:
    started = last = time.monotonic()
    while not done(engines := gw.engines()):
        if time.monotonic() - started > timeout:
            raise DemoFailed(f"{what}: not after {timeout:.0f} s")
        if time.monotonic() - last >= 10:
            last = time.monotonic()
            say(f"  {time.monotonic() - started:3.0f} s: waiting for {what}")
        time.sleep(0.2)
    return engines


def _turn_table(trajectory: Json) -> None:
    sdks = ("openai", "anthropic", "openai, streamed")
    say(f"  {'turn':>4} {'sdk':<17} {'prompt':>6} {'reused':>6} {'output':>6}  worker")
    for t in trajectory["turns"]:
        reused = sum(t["loss_mask"][: len(t["prompt_ids"])])
        sdk = sdks[t["index"]] if t["index"] < len(sdks) else "?"
        say(
            f"  {t['index']:>4} {sdk:<17} {len(t['prompt_ids']):>6} {reused:>6} {len(t['output_ids']):>6}  {t['worker']}"
        )


def _episode_with_kill(gw: GatewayRun, opts: argparse.Namespace, found: Findings) -> tuple[Episode, Killer]:
    episode = Episode(new_session(gw.url, "failover"))
    killer = Killer(gw, episode, opts.kill_after, opts.max_tokens)
    say(f"episode {episode.id}: openai SDK (tools), anthropic SDK at {episode.anthropic_base_url},")
    say(
        f"  then openai streamed ({opts.max_tokens} tokens, greedy), its worker killed once the gateway has "
        f"{killer.after} of its tokens"
    )
    try:
        try:
            episode.run(opts.max_tokens, killer.start)
        finally:
            killer.join()
        found.add("client_error", "none")
    except Exception as exc:  # what the demo is about: an SDK that saw an error
        found.add("client_error", f"{type(exc).__name__}: {exc}")
        found.check(False, "the client saw an error")
    found.add("streamed_answer", f"{episode.chunks} chunks with text, finish_reason {episode.finish_reason}")
    if killer.too_late or killer.victim is None:
        raise DemoFailed(
            f"{killer.too_late or 'the answer was not streamed'}, so no worker was killed: "
            "give a larger --max-tokens or a smaller --kill-after"
        )
    return episode, killer


def _failover(
    gw: GatewayRun, opts: argparse.Namespace, episode: Episode, killer: Killer, found: Findings
) -> Json:
    trajectory: Json = gw.get(f"/api/sessions/{episode.id}/trajectory")
    _turn_table(trajectory)
    event = failover_event(trajectory)
    if not found.check(event is not None, "no failover event in the trajectory"):
        return trajectory
    assert event is not None and killer.victim is not None
    found.add(
        "killed",
        f"{killer.victim['name']} (pid {killer.victim['pid']}) after {killer.at_token} tokens, mid-answer",
    )
    found.add(
        "failover",
        f"{event.get('from_worker')} -> {event.get('to_worker')} at token {event.get('token_index')} ({event.get('cause')})",
    )
    found.add("failover_detect_ms", event.get("detect_ms"))
    found.add("failover_lost_ms", event.get("lost_ms"))
    found.add("failover_sampling", event.get("sampling"))
    found.check(event.get("from_worker") == killer.victim["name"], "the failover names another worker")
    found.check(
        killer.at_token is not None
        and killer.at_token <= int(event.get("token_index") or 0) < opts.max_tokens,
        "the failover's token index is not where the worker was killed, mid-answer",
    )
    found.check(event.get("to_worker") is not None, "the stream was not resumed on another worker")
    statuses = [t["status"] for t in trajectory["turns"]]
    found.check(statuses == ["complete"] * 3, f"turn statuses {statuses}")
    return trajectory


def _compare(
    gw: GatewayRun, opts: argparse.Namespace, failed_over: Episode, trajectory: Json, found: Findings
) -> list[Json]:
    say("the same episode again in a new session, on the pool that is left, undisturbed")
    reference = Episode(new_session(gw.url, "reference"))
    reference.run(opts.max_tokens)
    ref_turns: list[Json] = gw.get(f"/api/sessions/{reference.id}/trajectory")["turns"]
    mismatches = token_mismatches(trajectory["turns"], ref_turns)
    compared = sum(len(t["output_ids"]) for t in ref_turns)
    found.add(
        "tokens_equal_undisturbed_run",
        f"{not mismatches} ({len(ref_turns)} turns, {compared} generated token ids compared, prompts too)",
    )
    found.add("text_equal_undisturbed_run", failed_over.texts == reference.texts)
    found.check(not mismatches, f"token ids differ from the undisturbed run: {mismatches}")
    found.check(failed_over.texts == reference.texts, "the client's text differs from the undisturbed run")
    return ref_turns


def _recovery(gw: GatewayRun, shadow: str, victim: str, found: Findings) -> None:
    """The shadow promoted, the killed worker fenced, and a replacement shadow started (and ready)."""
    say("waiting for the replacement shadow to be ready")
    started = time.monotonic()
    engines = _wait_for(
        gw,
        "the replacement shadow",
        lambda es: any(e["state"] == "shadow" for e in es) and any(e["state"] == "dead" for e in es),
        300,
    )
    timeline = gw.get("/api/dashboard/state")["timeline"]
    by_name = {e["name"]: e for e in engines}
    promoted = timeline_worker(timeline, "shadow_promoted")
    found.add("shadow_promoted", f"{promoted} (now {by_name.get(shadow, {}).get('state')})")
    found.check(promoted == shadow and by_name[shadow]["state"] == "ready", "the shadow was not promoted")
    found.add(
        "killed_worker",
        f"{victim} {by_name.get(victim, {}).get('state')} ({by_name.get(victim, {}).get('last_transition', {}).get('why')})",
    )
    replacement = timeline_worker(timeline, "replacement_started")
    cold = cold_start_s(timeline, replacement) if replacement else None
    state = by_name.get(replacement or "", {}).get("state")
    found.add(
        "replacement_shadow",
        f"{replacement} {state}, started in {cold} s (waited {time.monotonic() - started:.1f} s here)",
    )
    found.check(state == "shadow", "no replacement shadow became ready")


def show(gw: GatewayRun, opts: argparse.Namespace, found: Findings) -> None:
    engines = gw.engines()
    say("workers: " + ", ".join(f"{e['name']} {e['state']} (pid {e['pid']})" for e in engines))
    shadow = next((e["name"] for e in engines if e["state"] == "shadow"), None)
    if shadow is None:
        raise DemoFailed("the gateway started without a shadow")
    say(f"dashboard: {gw.url}/dashboard (open it now to watch the failover; --keep holds it open after)")
    with found.phase("episode"):
        episode, killer = _episode_with_kill(gw, opts, found)
    assert killer.victim is not None
    trajectory = _failover(gw, opts, episode, killer, found)
    with found.phase("reference"):
        reference = _compare(gw, opts, episode, trajectory, found)
    with found.phase("replacement_wait"):
        _recovery(gw, shadow, killer.victim["name"], found)
    httpx.post(f"{gw.url}/api/sessions/{episode.id}/reward", json={"reward": 1.0}, timeout=30)
    if opts.kills > 1:
        with found.phase("more_kills"):
            _more_kills(gw, opts, reference, found)
    found.add("dashboard", f"{gw.url}/dashboard")


def _more_kills(gw: GatewayRun, opts: argparse.Namespace, reference: list[Json], found: Findings) -> None:
    """``--kills N``: the episode N-1 more times, each with its worker killed mid-answer once the pool is
    back to full strength, each compared with the undisturbed run."""
    passed = 1
    for k in range(2, opts.kills + 1):
        quiet = Findings()
        _wait_for(gw, "full strength", lambda es: [e["state"] for e in es].count("shadow") == 1, 300)
        episode, killer = _episode_with_kill(gw, opts, quiet)
        trajectory = _failover(gw, opts, episode, killer, quiet)
        mismatches = token_mismatches(trajectory["turns"], reference)
        quiet.check(not mismatches, f"token ids differ from the undisturbed run: {mismatches}")
        assert killer.victim is not None
        found.add(f"kill_{k}", f"{killer.victim['name']} after {killer.at_token} tokens: "
                  + ("ok" if not quiet.problems else "; ".join(quiet.problems)))  # fmt: skip
        passed += not quiet.problems
        found.problems += [f"kill {k}: {p}" for p in quiet.problems]
    found.add("kills_mid_answer_exact", f"{passed}/{opts.kills}")
