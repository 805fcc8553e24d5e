"""Sessions (one per episode): created, looked up, and each turn's prompt planned in one (the session
read with the turn the request extends; `gateway.turns.prefix` builds the prompt ids from it)."""

from __future__ import annotations

import secrets
import time
from typing import Any

from core.errors import Conflict, NotFound, RequestError
from gateway.policy.tokenization import ChatTokenizer
from gateway.turns.prefix import PromptBuilder, PromptPlan, chain_keys
from store import SessionRecord, TrajectoryStore


class SessionManager:
    """Creates sessions and builds each turn's prompt ids, reusing earlier turns' exact tokens."""

    def __init__(self, store: TrajectoryStore, tokenizer: ChatTokenizer) -> None:
        self.store = store
        self.prompts = PromptBuilder(store, tokenizer)

    def create(
        self, metadata: dict[str, Any] | None = None, ephemeral: bool = False, group: str | None = None,
        seed: int | None = None,
    ) -> SessionRecord:  # fmt: skip
        """A new session (in routing `group`, if given). An ephemeral one (a plain ``/v1`` request) is
        stored with its first turn, so a request rejected before generation leaves nothing behind."""
        record = self.new_record(metadata, ephemeral, group, seed)
        return record if ephemeral else self.store.create_session(record)

    @staticmethod
    def new_record(
        metadata: dict[str, Any] | None = None, ephemeral: bool = False, group: str | None = None,
        seed: int | None = None,
    ) -> SessionRecord:  # fmt: skip
        """A new session's record, not stored yet (`create` stores it; a fork stores its children)."""
        prefix = "req" if ephemeral else "ses"
        return SessionRecord(
            id=f"{prefix}_{secrets.token_hex(16)}",  # 128 random bits: a session id is a capability
            created_at=time.time(),
            metadata=metadata or {},
            ephemeral=ephemeral,
            status="closed" if ephemeral else "open",  # nothing can send a second request to it
            group=group,
            seed=seed,
        )

    def get(self, session_id: str) -> SessionRecord:
        record = self.store.get_session(session_id)
        if record is None:
            raise refusal(session_id, None)
        return record

    def get_open(self, session_id: str) -> SessionRecord:
        record = self.get(session_id)
        if record.status != "open":
            raise refusal(session_id, record)
        return record

    def plan(
        self,
        session: SessionRecord | str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> tuple[PromptPlan, list[str], SessionRecord]:
        """The prompt ids for ``messages``, the chain keys of the messages (for the ext key), and the
        session: `session` itself, or the open session of that id, read with the turn the messages
        extend in one look-up (refused as `get_open` refuses, before any templating)."""
        keys = chain_keys(tools, messages)
        candidates = [keys[j] for j, m in enumerate(messages) if m["role"] == "assistant"]
        if isinstance(session, str):
            found, parent = self.store.session_and_parent(session, candidates)
            if found is None or found.status != "open":
                raise refusal(session, found)
            session = found
        else:  # a plain request's own session (it has no turns) or an auxiliary call's side session
            parent = None if session.ephemeral else self.store.find_turn_by_ext_keys(session.id, candidates)
        return self.prompts.build(session.id, parent, messages, tools, keys), keys, session


def refusal(session_id: str, record: SessionRecord | None) -> RequestError:
    """Why a request to session `session_id` (read as `record`) cannot run there: unknown, or not open."""
    if record is None:
        return NotFound(
            f"unknown session '{session_id}'; create one with POST /api/sessions and use its base_url",
            param="session_id",
            code="session_not_found",
        )
    return Conflict(
        f"session '{session_id}' is {record.status}; create a new session for a new episode",
        param="session_id",
        code="session_closed",
    )
