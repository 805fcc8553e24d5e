"""The project's one exception tree. Every error Belayer raises is a `BelayerError`; a builtin base in
parentheses is a mixin, so ``except ValueError`` (say) still catches the class.

::

    BelayerError
    ├── ConfigError                    a setting cannot work (start-up); the message says what to change
    │   └── UnsafeStore (PermissionError)            core.shm_weights: a weight store others could write to
    ├── EngineError                    anything between the gateway and an inference worker
    │   ├── EngineUnavailable          connection refused/reset, worker died, no healthy worker
    │   │   ├── EngineUnreachable      the connection could not be made: the request never reached it
    │   │   └── WorkerExited           a launched worker's process exited (engine_pool.workers.exits): streams cut at once
    │   ├── EngineTimeout              no answer (or no token) within a deadline
    │   ├── EngineRejected             the engine answered 4xx: bad input, never retried
    │   ├── EngineServerError          the engine answered 5xx (or an error event) for one request
    │   ├── EngineRequestFailed        a request that healthy workers fail on: its own fault
    │   │   └── QueryOfDeath           a request that crashed the workers it ran on (gateway.turns.quarantine)
    │   └── EngineProtocolError        the engine answered something that is not its protocol
    ├── AuxiliaryUnavailable           an auxiliary model's provider cannot be reached (not the policy)
    ├── RequestError                   the client's request cannot be served as sent (-> 4xx)
    │   ├── InvalidRequest             malformed body, wrong type, unsupported parameter
    │   │   ├── RequestTooLarge        the body is over the size limit
    │   │   └── UnsupportedMediaType   the body is not declared as JSON
    │   ├── RequestTimeout             the request's body stopped arriving (no bytes for a while)
    │   ├── NotFound                   unknown session, model or route
    │   ├── ContextLengthExceeded      prompt + completion over the model's context window
    │   ├── Conflict                   e.g. a request on a closed session
    │   ├── Unauthorized               an API route without (or with a wrong) API token
    │   ├── Forbidden                  an admin endpoint without the admin token; a route turned off
    │   └── SandboxesDisabled          a sandbox route on a gateway without sandboxes
    ├── StoreError                     the trajectory store failed
    ├── UnknownEvent (ValueError)      an event kind core.events does not register, or data that does not fit it
    ├── SandboxError                   anything raised by sandbox/ and the gateway's sandbox manager
    │   ├── SandboxUnavailable (ConnectionError)     the container engine does not answer
    │   │   └── NoSandboxSlot                        no cluster node has a free sandbox slot
    │   ├── NodeLost                                 the cluster node that held it is gone
    │   ├── SandboxNotFound (LookupError)            unknown or destroyed sandbox / checkpoint
    │   │   ├── NoSandbox                            the session has no sandbox
    │   │   └── ImageNotFound                        the image to create a sandbox from is missing
    │   ├── SandboxFileNotFound (FileNotFoundError)  read_file on a path that does not exist
    │   ├── SandboxArgumentError (ValueError)        a bad argument: env name, shell session name
    │   │   ├── PathEscapeError                      a file path that leaves the sandbox's root
    │   │   ├── SandboxPathRefused                   a directory, a second symbolic link or a loop
    │   │   └── SandboxFileTooLarge                  a file read over sandbox.max_read_bytes
    │   ├── SandboxTimeout (TimeoutError)            exec ran past its timeout; carries partial output
    │   ├── SandboxExists                            the session already has a sandbox
    │   ├── SandboxJournalFull                       its journal is full and no checkpoint could empty it
    │   ├── NoCheckpoint (LookupError)               a restore without a (such) checkpoint
    │   ├── SandboxFailed                            it failed, and there was nothing to restore
    │   ├── SandboxCallFailed                        this call broke it twice (after a replay)
    │   ├── SandboxRestored                          it failed during this call and was restored
    │   ├── CheckpointError                          checkpoint (filesystem or process dump) failed
    │   │   └── RestoreError                         restore from a checkpoint failed
    │   │       └── CheckpointUnreadable                 sandbox.checkpoint_store: an object cannot be read
    │   │           ├── CheckpointMissing (LookupError)  ... because the store holds no such object
    │   │           └── CheckpointTampered               ... or holds what the gateway did not write there
    │   └── ImageBuildError                          building a sandbox image failed
    ├── HarnessError                   a harness could not be installed or run
    ├── TaskError (ValueError)         a task directory is not usable
    │   └── RewardFileError                          a Harbor task's reward files give no reward (sandbox.sessions.verify_harbor)
    ├── BenchError (RuntimeError)      a benchmark (or a service it starts) could not run
    │
    │   raised outside this module, by the layer that owns them:
    ├── Preempted                      gateway.turns.guard: a weight update cut a stream; the turn resumes
    ├── ClientError                    belayer.client: the gateway answered the trainer's client with an error
    │   └── GatewayUnreachable (ConnectionError)     no answer, or the connection broke
    ├── DemoFailed                     belayer.cli.demo: the demo could not show what it shows
    └── LayoutUnavailable              belayer_vllm.layout: no weight owner's layout to map (load from disk)

Outside the tree on purpose: ``sandbox.checkpoint_store._NotOurs`` (a link or device found in the store:
control flow, always turned into a ``CheckpointError`` there), ``sandbox.fake_shell._Exit`` (the fake shell's ``exit`` builtin, control
flow its script runner always catches) and ``StepFailed`` in ``deploy/gpu/cuda_ipc_check.py`` (a
script that needs only PyTorch, so it imports nothing of Belayer).

Foreign errors are translated at one boundary each: httpx in ``engine_pool.engine.client`` (and, for
auxiliary providers, ``gateway.turns.auxiliary``), Docker in ``sandbox.docker_backend.engine.docker_errors``.
The gateway maps this tree to OpenAI and Anthropic error JSON in one table, ``gateway.http.errors``.

>>> issubclass(PathEscapeError, BelayerError) and issubclass(PathEscapeError, ValueError)
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - only for annotations (SandboxRestored.info, QueryOfDeath.event)
    from core import events


class BelayerError(Exception):
    """Root of every error raised by Belayer."""


class ConfigError(BelayerError):
    """A setting that cannot work; raised at start-up, before anything is launched."""


# --------------------------------------------------------------------------- engines
class EngineError(BelayerError):
    """Something went wrong talking to an inference worker."""


class EngineUnavailable(EngineError):
    """The worker cannot be reached or died mid-request; another worker may serve the request."""


class EngineUnreachable(EngineUnavailable):
    """The connection to the worker could not be made: the request never reached it."""


class WorkerExited(EngineUnavailable):
    """A vital process of a launched worker exited (``engine_pool.workers.exits``): the streams it was running are
    failed at once, before their connections break. `at`: when the pool noticed (``time.monotonic()``)."""

    def __init__(self, message: str, at: float) -> None:
        super().__init__(message)
        self.at = at


class EngineTimeout(EngineError, TimeoutError):
    """The worker did not answer within the deadline."""


class EngineRejected(EngineError):
    """The worker rejected the request (HTTP 4xx). Retrying elsewhere would fail the same way.
    `engine_status` is the engine's own HTTP status (what the gateway answers is in its table)."""

    def __init__(self, message: str, engine_status: int = 400) -> None:
        super().__init__(message)
        self.engine_status = engine_status


class EngineServerError(EngineError):
    """The worker answered an HTTP 5xx (or sent an error event) for a request. Whether the worker or the
    request is to blame is decided by a health probe, not by this one answer."""

    def __init__(self, message: str, engine_status: int = 500) -> None:
        super().__init__(message)
        self.engine_status = engine_status


class EngineRequestFailed(EngineError):
    """Healthy workers fail on this request (a poison request): retrying it unchanged fails again.
    No worker is fenced for it."""


class QueryOfDeath(EngineRequestFailed):
    """A request that crashed the workers it ran on: not retried, and refused for a while
    (``gateway.turns.quarantine``). `event` is its ``query_of_death`` event's data."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.event: events.QueryOfDeath | None = None


class EngineProtocolError(EngineError):
    """The worker answered, but not in its protocol (a malformed stream line, a body that is not JSON)."""


class AuxiliaryUnavailable(BelayerError):
    """An auxiliary route's provider (not the policy's engines) cannot be reached."""


# --------------------------------------------------------------------------- requests
class RequestError(BelayerError):
    """The client's request is wrong. `param` names the offending field when there is one; `code`
    refines the table's code for this class when given."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class InvalidRequest(RequestError):
    """Malformed body, wrong type or unsupported parameter."""


class RequestTooLarge(InvalidRequest):
    """The request body is over the gateway's size limit."""


class UnsupportedMediaType(InvalidRequest):
    """The body is declared as another media type than JSON (a cross-site form or text/plain POST)."""


class RequestTimeout(RequestError):
    """The client stopped sending its request's body (no bytes within the body timeout)."""


class NotFound(RequestError):
    """An unknown session, model or resource."""


class ContextLengthExceeded(RequestError):
    """Prompt plus requested completion do not fit in the model's context window."""


class Conflict(RequestError):
    """The request conflicts with the resource's state (e.g. the session is closed)."""


class Unauthorized(RequestError):
    """An API route called without (or with a wrong) API token."""


class Forbidden(RequestError):
    """An admin endpoint called without (or with a wrong) admin token."""


class SandboxesDisabled(RequestError):
    """A sandbox route on a gateway started without sandboxes."""


class StoreError(BelayerError):
    """The trajectory store failed."""


class UnknownEvent(BelayerError, ValueError):
    """An event kind that `core.events.REGISTRY` does not hold, or data that does not fit its kind's
    fields: a publisher that names no registered kind is a bug, refused where it publishes."""


# --------------------------------------------------------------------------- sandboxes
class SandboxError(BelayerError):
    """Root of every sandbox failure: the backend's and the session manager's."""


class SandboxUnavailable(SandboxError, ConnectionError):
    """The container engine cannot be reached."""


class NoSandboxSlot(SandboxUnavailable):
    """No node of the cluster has a free sandbox slot (`sandbox.cluster`)."""


class NodeLost(SandboxError):
    """The cluster node that held the sandbox is gone (`sandbox.cluster`): it is restored elsewhere."""


class SandboxNotFound(SandboxError, LookupError):
    """The sandbox (or checkpoint) does not exist, or no longer exists."""


class NoSandbox(SandboxNotFound):
    """The session has no sandbox (none was created, or it was destroyed)."""


class ImageNotFound(SandboxNotFound):
    """The image a sandbox was to be created from does not exist."""


class SandboxFileNotFound(SandboxError, FileNotFoundError):
    """A file read from a sandbox does not exist."""


class SandboxArgumentError(SandboxError, ValueError):
    """An argument the sandbox cannot take (an environment variable or shell session name)."""


class PathEscapeError(SandboxArgumentError):
    """A file path resolves outside the sandbox's root directory."""


class SandboxPathRefused(SandboxArgumentError):
    """A file path the file API does not take: not a regular file (a directory), or one that needs a
    second symbolic link (or a loop of them) to resolve."""

    @classmethod
    def links(cls, path: str) -> SandboxPathRefused:
        """The refusal of `path` for its links, worded alike by every backend."""
        return cls(
            f"{path!r} resolves through more than one symbolic link (or a loop of them); the file API "
            "follows one: name the file's real path"
        )


class SandboxFileTooLarge(SandboxArgumentError):
    """A file to read is larger than the gateway reads whole (``sandbox.max_read_bytes``); told by the
    file's size before any of its bytes were read."""

    @classmethod
    def of(cls, path: str, size: int, max_bytes: int) -> SandboxFileTooLarge:
        """The refusal of file `path` of `size` bytes, worded alike by every backend."""
        return cls(
            f"{path} holds {size} bytes, over the {max_bytes} that the file API reads at most "
            "(sandbox.max_read_bytes); read a part with exec (e.g. `head -c 1000000 FILE | base64`), or "
            "raise the limit"
        )


class SandboxTimeout(SandboxError, TimeoutError):
    """A command ran past its timeout and was killed; `stdout`/`stderr` hold what it printed."""

    def __init__(self, message: str, *, stdout: str = "", stderr: str = "") -> None:
        super().__init__(message)
        self.stdout = stdout
        self.stderr = stderr


class SandboxExists(SandboxError):
    """The session already has a sandbox."""


class SandboxJournalFull(SandboxError):
    """The tool calls since the sandbox's last checkpoint hold more than ``sandbox.max_journal_bytes``,
    and no checkpoint could be taken to empty the journal (checkpoints are off, or it failed)."""


class NoCheckpoint(SandboxError, LookupError):
    """A restore was asked for, but the session has no (such) checkpoint."""


class SandboxFailed(SandboxError):
    """The sandbox failed and there was no checkpoint to restore; the session has no sandbox now."""


class SandboxCallFailed(SandboxError):
    """This call broke the sandbox twice (the second time after a restore); it was restored without it."""


class SandboxRestored(SandboxError):
    """The sandbox failed during this call and was restored; `info` (the restore's record, its
    ``sandbox_restored`` event) says after which turn to resume (`info.keep_through`)."""

    def __init__(self, message: str, info: events.SandboxRestored) -> None:
        super().__init__(message)
        self.info = info


class CheckpointError(SandboxError):
    """Taking a checkpoint (filesystem snapshot or CRIU process dump) failed."""


class RestoreError(CheckpointError):
    """Restoring a sandbox from a checkpoint failed."""


class CheckpointUnreadable(RestoreError):
    """An object of the checkpoint store (`sandbox.checkpoint_store`) cannot be read: the store does not
    answer, or refuses. The message names the store's URL and the key, and what to check."""


class CheckpointMissing(CheckpointUnreadable, LookupError):
    """The checkpoint store holds no object under the key (deleted, or written to another store)."""


class CheckpointTampered(CheckpointUnreadable):
    """A checkpoint fails its authentication: a part differs from the digest the gateway recorded, its
    record from the MAC the gateway signed it with (or it carries none), or the store holds a symbolic link.
    Someone who can write the store changed it; nothing of it was unpacked or started."""


class ImageBuildError(SandboxError):
    """Building or importing a sandbox image failed."""


# --------------------------------------------------------------------------- harnesses and tasks
class HarnessError(BelayerError):
    """A harness could not be installed, configured or run."""


class TaskError(BelayerError, ValueError):
    """A task directory is missing something or holds something invalid."""


class RewardFileError(TaskError):
    """The reward files a Harbor task's tests wrote give no reward (`sandbox.sessions.verify_harbor.read_rewards`);
    `reason` says which way (``no_reward_file``, ``reward_file_invalid``, ``no_reward_key``), `rewards`
    holds what was read (a reward.json without a ``reward`` key)."""

    def __init__(self, reason: str, message: str, rewards: dict[str, float] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.rewards = rewards


class BenchError(BelayerError, RuntimeError):
    """A benchmark (or the service it needed) could not run: a server did not start, a path failed."""
