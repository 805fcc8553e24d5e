"""Talking to one engine in token ids: the client (`EngineClient`, ``engine.client``), the gateway's own
HTTP/1.1 client on asyncio (``engine.http11``) and the transport that chooses it (``engine.transport``)."""
