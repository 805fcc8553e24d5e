"""The HTTP gateway: OpenAI- and Anthropic-compatible routes in front of the engine pool, token-in/token-out.

Folders by concern, from the outside in (import-linter keeps this order: a module imports only from
those below it):

- `serve/`: uvicorn with a production proxy's limits (`serve.server`), and N processes on one port;
- `app.py`: the Starlette app: its routes, the error table, and the lifespan that builds the long-lived
  objects;
- `api/`: the routes. The protocol folders (`api/openai/`, `api/anthropic/`) keep vLLM's split of
  routes, wire models and serving logic; the trainer's and operator's endpoints have a module each
  (`sessions`, `export`, `finished`, `weights`, `engines`, `observe`, `sandbox`, and
  `sandbox_listener`, what a sandbox can reach);
- `gateway.py`: the `Gateway` object, the long-lived parts a route reaches;
- `turns/`: one turn from prompt ids to a stored trajectory: the runner, mid-stream failover
  (`turns.failover`, its guard `turns.guard`), the output pipeline (`turns.output`), in-flight writes, prefix reuse (`turns.sessions`), auxiliary models;
- `observe/`: Prometheus metrics, the request and recovery logs, the dashboard;
- `http/`: who may call what (`http.access`), request bodies, the error table;
- `config.py`: every setting and its default;
- `policy/`: what the gateway knows of the policy model: its chat template and tokenizer, its output
  parsers, its weight versions (`policy.weights`).

The trajectory store is the package `store`; the sandboxes, with their session-aware manager and
checkpoints in inference bubbles, are `sandbox` and `sandbox.sessions`; the engine pool is
`engine_pool`.
"""
