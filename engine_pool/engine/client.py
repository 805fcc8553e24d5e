"""The one client for engine I/O: token ids in, token ids (with logprobs) out, over ``httpx``.

It speaks vLLM's ``/v1/completions`` with a token-id prompt and ``return_token_ids``, streamed, so the
gateway sees every token as soon as it is generated. Transport errors are translated here, and only
here (``transport_errors``), into ``core.errors``: connection failures become ``EngineUnavailable``,
time-outs ``EngineTimeout``, 4xx answers ``EngineRejected`` (bad input, never retried), and an answer
that is not the engine's protocol (a stream line or body that is not JSON) ``EngineProtocolError``.

Example::

    async with httpx.AsyncClient() as http:
        engine = EngineClient("http://127.0.0.1:8000", "tiny", http)
        async for chunk in engine.generate([1, 2, 3], SamplingParams(max_tokens=8)):
            print(chunk.token_ids, chunk.logprobs)

The same over the scripted fake engine (``engine_pool.fake``), whose next reply is tokens 11, 12, 2:

>>> import asyncio
>>> from engine_pool.fake import FakeEngine
>>> async def generate() -> list[int]:
...     transport = httpx.ASGITransport(FakeEngine(outputs=[[11, 12, 2]]).app())
...     async with httpx.AsyncClient(transport=transport) as http:
...         engine = EngineClient("http://fake-engine", "fake", http)
...         chunks = [c async for c in engine.generate([1, 2, 3], SamplingParams(max_tokens=8))]
...     return [t for c in chunks for t in c.token_ids]
>>> asyncio.run(generate())
[11, 12, 2]
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from core import fastjson
from core.errors import (
    EngineProtocolError,
    EngineRejected,
    EngineServerError,
    EngineTimeout,
    EngineUnavailable,
    EngineUnreachable,
)

_TOKEN_ID_PREFIX = "token_id:"
REQUEST_ID_HEADER = "X-Request-Id"


def engine_request_id(session_id: str, turn_index: int) -> str:
    """The id of one submission of a turn to an engine: its session, its turn, and a random part (a
    failover resubmits the turn, and vLLM refuses two running requests with one id).

    >>> rid = engine_request_id("ses_ab12", 3)
    >>> rid.startswith("ses_ab12.t3."), session_of_request(rid), session_of_request("cmpl-x")
    (True, 'ses_ab12', None)
    """
    return f"{session_id}.t{turn_index}.{secrets.token_hex(4)}"


def session_of_request(request_id: str | None) -> str | None:
    """The session an `engine_request_id` names (None for another request id, or none)."""
    if not request_id:
        return None
    session, _, rest = request_id.partition(".t")
    return session if session and rest.partition(".")[2] else None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling parameters the gateway passes through to the engine unchanged."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    key: int | None = None
    """Keyed sampling (``core.keyed``): the turn's key; the worker draws each token from it and the
    token's position (vLLM: ``belayer_vllm.keyed``, through ``vllm_xargs``). None: the engine's sampler."""
    position: int = 0
    """Keyed sampling: the turn's position of the first token this request generates (a resubmission
    after a failover goes on where the tokens so far end)."""

    def keyed_args(self) -> dict[str, Any]:
        """Keyed sampling's ``vllm_xargs`` (``belayer_vllm.keyed``): the key, the position, and the
        distribution to draw from (the engine itself is asked for greedy decoding of the one choice).

        >>> SamplingParams(temperature=0.7, top_k=5, key=9, position=3).keyed_args()
        {'belayer_key': 9, 'belayer_position': 3, 'belayer_temperature': 0.7, 'belayer_top_p': 1.0, 'belayer_top_k': 5}
        """
        args: dict[str, Any] = {"belayer_key": self.key, "belayer_position": self.position,
                                "belayer_temperature": self.temperature, "belayer_top_p": self.top_p}  # fmt: skip
        if self.top_k is not None:
            args["belayer_top_k"] = self.top_k
        return args

    def to_engine(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            # The chosen token's logprob is always logged; top-k alternatives only when asked for.
            "logprobs": self.top_logprobs,
        }
        if self.top_k is not None:
            body["top_k"] = self.top_k
        if self.key is not None:  # the worker's keyed sampler draws: its own sampler only takes that choice
            body["vllm_xargs"] = self.keyed_args()
            body.update(temperature=0.0, top_p=1.0)  # greedy there: no second draw, no sort
            body.pop("top_k", None)
        elif self.seed is not None:
            body["seed"] = self.seed
        if self.stop:
            body["stop"] = list(self.stop)
        if self.presence_penalty:
            body["presence_penalty"] = self.presence_penalty
        if self.frequency_penalty:
            body["frequency_penalty"] = self.frequency_penalty
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


@dataclass(slots=True)
class TokenChunk:
    """New tokens from one engine event; ``finish_reason`` is set on the last one."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    max_model_len: int


def _token_id(token: str) -> int:
    return int(token[len(_TOKEN_ID_PREFIX) :]) if token.startswith(_TOKEN_ID_PREFIX) else -1


def parse_chunk(choice: dict[str, Any], with_tops: bool = True) -> TokenChunk:
    """Turn one completions ``choice`` (streamed or not) into a ``TokenChunk``.

    >>> parse_chunk({"token_ids": [5], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "stop"})
    TokenChunk(token_ids=[5], logprobs=[-0.5], top_logprobs=[], finish_reason='stop')
    """
    try:
        return _parse_chunk(choice, with_tops)
    except (AttributeError, TypeError, ValueError) as e:
        raise EngineProtocolError(f"engine sent a malformed choice ({e!r}): {str(choice)[:200]}") from e


def _parse_chunk(choice: dict[str, Any], with_tops: bool) -> TokenChunk:
    ids = [int(t) for t in choice.get("token_ids") or []]
    lp = choice.get("logprobs") or {}
    logprobs = [float(x) if x is not None else 0.0 for x in lp.get("token_logprobs") or []]
    tops = (
        [[(_token_id(tok), float(v)) for tok, v in (d or {}).items()] for d in lp.get("top_logprobs") or []]
        if with_tops
        else []
    )
    return TokenChunk(ids, logprobs, tops, choice.get("finish_reason"))


def parse_prompt_logprobs(entries: list[Any], prompt_ids: list[int]) -> list[float | None]:
    """vLLM's ``prompt_logprobs``: per position None or ``{token: {"logprob", "rank", ...}}``, the
    token keyed by its id (or ``token_id:<id>``); pick each prompt token's own entry."""
    out: list[float | None] = []
    for i, tid in enumerate(prompt_ids):
        entry = entries[i] if i < len(entries) else None
        value = None
        if isinstance(entry, dict):
            hit = entry.get(str(tid), entry.get(f"token_id:{tid}"))
            if isinstance(hit, dict):
                value = hit.get("logprob")
            elif isinstance(hit, int | float):
                value = hit
        out.append(float(value) if value is not None else None)
    return out


def _choices(event: Any) -> list[dict[str, Any]]:
    """An engine answer's ``choices``; anything else in their place is a protocol error."""
    choices = event.get("choices") if isinstance(event, dict) else None
    if choices is None:
        return []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise EngineProtocolError(
            f"engine sent 'choices' that are not a list of objects: {str(choices)[:200]}"
        )
    return choices


def merge_chunks(chunks: list[TokenChunk]) -> TokenChunk | None:
    """One chunk for several engine events that arrived together: when the engine outpaces the
    gateway, the per-token work (detokenizing, parsing, one SSE write to the client) is batched."""
    if len(chunks) <= 1:
        return chunks[0] if chunks else None
    out = TokenChunk([], [], [], None)
    for c in chunks:
        out.token_ids += c.token_ids
        out.logprobs += c.logprobs
        out.top_logprobs += c.top_logprobs
        out.finish_reason = c.finish_reason or out.finish_reason
    return out


async def _sse_batches(resp: httpx.Response) -> AsyncIterator[list[dict[str, Any]]]:
    """The JSON events of a server-sent-event body, in batches of those that arrived in one read.
    Reads the body to its end (past ``[DONE]``), so that the connection goes back to the pool."""
    buf = b""
    async for raw in resp.aiter_bytes():
        buf += raw
        batch = []
        while (cut := buf.find(b"\n\n")) >= 0:
            line, buf = buf[:cut], buf[cut + 2 :]
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = _json(line[6:], "stream event")
            if not isinstance(event, dict):
                raise EngineProtocolError(f"engine sent a stream event that is not an object: {line[:200]!r}")
            if "error" in event:
                raise EngineServerError(f"engine failed mid-stream: {str(event['error'])[:300]}")
            batch.append(event)
        if batch:
            yield batch


def _json(raw: bytes, what: str) -> Any:
    try:
        return fastjson.loads(raw)  # engine output: token ids and logprobs (orjson)
    except ValueError as e:
        raise EngineProtocolError(f"engine sent a {what} that is not JSON ({e}): {raw[:200]!r}") from e


def _check_status(base_url: str, status: int, body: bytes) -> None:
    """An engine's HTTP error: 4xx is the request's fault (never retried), 5xx the engine's."""
    if status >= 500:
        detail = body.decode(errors="replace")[:300]
        raise EngineServerError(f"engine {base_url} answered HTTP {status}: {detail}", status)
    if status >= 400:
        raise _rejection(status, body)


@contextlib.contextmanager
def transport_errors(base_url: str) -> Iterator[None]:
    """The one place where httpx's errors become the engine errors of ``core.errors``."""
    try:
        yield
    except httpx.TimeoutException as e:
        raise EngineTimeout(f"engine {base_url} timed out: {e!r}") from e
    except httpx.ConnectError as e:  # the request never reached the worker (gateway.turns.quarantine)
        raise EngineUnreachable(f"engine {base_url} unreachable: {e!r}") from e
    except (httpx.TransportError, httpx.StreamError) as e:
        raise EngineUnavailable(f"engine {base_url} unreachable: {e!r}") from e


def _rejection(status: int, body: bytes) -> EngineRejected:
    try:
        payload = json.loads(body)
        err = payload.get("error", payload)
        message = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        message = body.decode(errors="replace")[:500]
    return EngineRejected(str(message or f"engine answered HTTP {status}"), status)


class EngineClient:
    """A client for one engine (worker) URL. The ``httpx.AsyncClient`` is injected and shared."""

    def __init__(
        self,
        base_url: str,
        model: str,
        http: httpx.AsyncClient,
        read_timeout: float | None = None,
        api_key: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._http = http
        # a launched worker's key (core.worker_auth), on every request: the client is shared by engines
        self._auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(connect=5.0, read=read_timeout, write=30.0, pool=30.0)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stream: bool = True,
        request_id: str | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """The tokens generated after ``prompt_ids``: one chunk per engine event when ``stream``,
        else a single chunk once the engine is done (cheaper for short, non-streamed requests).
        ``request_id`` (see `engine_request_id`) goes as ``X-Request-Id``, which vLLM takes as its own
        request id: its logs and traces then name the session and turn."""
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "stream": stream,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **params.to_engine(),
        }
        tops = params.top_logprobs > 0
        url = f"{self.base_url}/v1/completions"
        with transport_errors(self.base_url):
            headers = {"content-type": "application/json", **self._auth}
            if request_id:
                headers[REQUEST_ID_HEADER] = request_id
            async with self._http.stream(
                "POST", url, content=fastjson.dumps(body), headers=headers, timeout=self._timeout
            ) as resp:
                if resp.status_code >= 400:
                    _check_status(self.base_url, resp.status_code, await resp.aread())
                if not stream:
                    for choice in _choices(_json(await resp.aread(), "response")):
                        yield parse_chunk(choice, tops)
                    return
                async for events in _sse_batches(resp):
                    chunk = merge_chunks([parse_chunk(c, tops) for ev in events for c in _choices(ev)])
                    if chunk is not None:
                        yield chunk

    async def prompt_logprobs(self, prompt_ids: list[int]) -> list[float | None]:
        """The model's logprob of each prompt token given the ones before it (None for the first):
        one forward pass over the prompt (``prompt_logprobs=0``, one generated token, discarded)."""
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        with transport_errors(self.base_url):
            resp = await self._http.post(
                f"{self.base_url}/v1/completions", json=body, headers=self._auth, timeout=self._timeout
            )
        _check_status(self.base_url, resp.status_code, resp.content)
        entries = (_choices(_json(resp.content, "response")) or [{}])[0].get("prompt_logprobs") or []
        return parse_prompt_logprobs(entries, prompt_ids)

    async def update_weights(self, path: str, version: str, timeout: float = 600.0) -> None:
        """Load new weights in place and name their version, through vLLM's development endpoints
        (the server runs with ``VLLM_SERVER_DEV_MODE=1``; launched workers do): ``POST /pause``
        (``mode=abort``: the gateway has already drained or cut its own requests), ``POST
        /collective_rpc`` calling ``reload_weights(weights_path=path)`` on every model worker, ``POST
        /update_weight_version``, then ``POST /resume``, which is sent after a failed load too. An engine
        without those endpoints answers 404: `EngineRejected`; a failed load is an `EngineServerError`."""
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": path}, "timeout": timeout}
        await self._post("/pause?mode=abort", None, timeout)
        try:
            await self._post("/collective_rpc", rpc, timeout)
            await self._post("/update_weight_version", {"new_version": version}, timeout)
        finally:
            await self._post("/resume", None, timeout)

    async def name_weight_version(self, version: str, timeout: float = 10.0) -> None:
        """Name the version of the weights the engine holds, without loading any (``POST
        /update_weight_version``): a worker that mapped a weight owner's weights of `version`."""
        await self._post("/update_weight_version", {"new_version": version}, timeout)

    async def collective_rpc(self, method: str, kwargs: dict[str, str], timeout: float = 120.0) -> list[Any]:
        """Call `method` on every model worker of the engine (``POST /collective_rpc``, a development
        endpoint; vLLM runs it between engine steps, without pausing generation): one result per worker.
        `EngineRejected` without the endpoint, `EngineServerError` when the call failed."""
        rpc = {"method": method, "kwargs": kwargs, "timeout": timeout}
        with transport_errors(self.base_url):
            resp = await self._http.post(
                f"{self.base_url}/collective_rpc", json=rpc, headers=self._auth, timeout=timeout
            )
        _check_status(self.base_url, resp.status_code, resp.content)
        body = _json(resp.content, "collective_rpc response") if resp.content else {}
        results = body.get("results") if isinstance(body, dict) else None
        return list(results) if isinstance(results, list) else []

    async def weight_version(self, timeout: float = 5.0) -> str | None:
        """The version the engine says it holds (``GET /weight_info``; vLLM's is ``default`` until one
        is set); None when it does not say (no development endpoints, or not answering)."""
        try:
            resp = await self._http.get(f"{self.base_url}/weight_info", headers=self._auth, timeout=timeout)
            version = resp.json().get("weight_version") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return version if isinstance(version, str) else None

    async def _post(self, path: str, body: dict[str, Any] | None, timeout: float) -> None:
        with transport_errors(self.base_url):
            resp = await self._http.post(
                f"{self.base_url}{path}", json=body, headers=self._auth, timeout=timeout
            )
        _check_status(self.base_url, resp.status_code, resp.content)

    async def health(self, timeout: float = 2.0) -> bool:
        try:
            resp = await self._http.get(f"{self.base_url}/health", timeout=timeout)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def model_info(self, timeout: float = 5.0) -> ModelInfo:
        """The served model's name and context window, from ``GET /v1/models``."""
        try:
            resp = await self._http.get(f"{self.base_url}/v1/models", headers=self._auth, timeout=timeout)
            resp.raise_for_status()
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"engine {self.base_url} did not list its models: {e!r}") from e
        try:
            card = _json(resp.content, "model list")["data"][0]
            return ModelInfo(str(card["id"]), int(card.get("max_model_len") or 0))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineProtocolError(f"engine {self.base_url} listed no usable model: {e!r}") from e
