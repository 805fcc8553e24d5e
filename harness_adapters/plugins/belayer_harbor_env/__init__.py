"""A Harbor environment backed by Belayer: each Harbor trial is one Belayer session with a sandbox.

Loaded by Harbor (PyPI ``harbor``, the runner behind Terminal-Bench 2) from its own venv, so it needs
only harbor, httpx and the standard library; Belayer's packages are never imported here. A package of
its own (relative imports only), so Harbor imports it by the name ``belayer_harbor_env`` from
``harness_adapters/plugins`` and Belayer's tools check it as ``harness_adapters.plugins.belayer_harbor_env``::

    PYTHONPATH=harness_adapters/plugins harbor run -p TASK --agent oracle \\
        --env belayer_harbor_env:BelayerEnvironment --ek gateway=http://127.0.0.1:8000

``start`` builds the task's image (``environment/Dockerfile``, with the local ``docker build``, tagged
by the environment's content hash, never pulled) or takes its ``docker_image`` (which must be on the
gateway's Docker engine already), then creates the session with its sandbox in one call
(``POST /api/sessions`` with a sandbox spec: the image, env, cpus, memory, and ``/`` as the sandbox's
workdir, the root of the paths its file API takes: Harbor's files go to /tests, /solution, /logs...).
``exec``, ``upload_*`` and ``download_*`` go through the session's sandbox routes
(``/api/sessions/{id}/sandbox/{exec,files}``): the gateway journals each call, checkpoints the
sandbox in the inference bubbles of the session's model calls, and restores it (replaying the calls
since the checkpoint) when it fails. ``stop`` gives the session the trial's reward (the verifier's
``reward.txt`` or ``reward.json``, which Harbor has downloaded by then) and closes it, which removes
the sandbox; the trajectory stays.

Each ``exec`` runs in a fresh child of the sandbox's shell (``bash -c``, or ``sh -c`` where the image
has no bash), so its ``cd`` and variables do not leak into the next one, as with ``docker exec``; a
``user`` other than root runs it through ``runuser`` (or ``su``).

**The agent's model calls** must go to the session's URLs, which exist only once ``start`` has run:

- an agent installed in the sandbox: the sandbox joins the gateway-only network (``network=gateway``,
  the default), whose containers get ``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL`` and
  ``BELAYER_SESSION_URL`` for their session. The variables Harbor passes to an ``exec`` win over the
  container's, so any of their values that starts with the gateway's own URL (give Harbor
  ``--base-url <gateway>/v1``, or ``--ae OPENAI_BASE_URL=<gateway>/v1``) is rewritten to the session's
  in-sandbox URL;
- an agent on the host that calls the model itself (terminus-2): `BelayerTerminus2`, terminus-2 whose
  LiteLLM client is pointed at the trial's ``{gateway}/s/{id}/v1`` before it runs
  (``--agent belayer_harbor_env:BelayerTerminus2 --model openai/policy``). Any other host-side agent can
  read `BelayerEnvironment.openai_base_url` / `anthropic_base_url` in its ``run``.

Options (``--ek key=value``): ``gateway`` (else ``BELAYER_URL``), ``api_token`` (else
``BELAYER_API_TOKEN``; an ``--ek`` value lands in the job's config.json, the variable does not),
``network`` (``none``, ``gateway``, ``full``; default ``gateway``, ``none`` for a task whose
``network_mode`` is ``no-network``), ``recovery`` (``replay`` or ``truncate``: see the sandbox API),
``checkpoint_after_start`` (checkpoint once the sandbox is ready, so a failure before the first model
call restores there instead of failing the trial), ``build_network`` (``docker build --network``),
``memory_mb`` and ``cpus`` (when the task names none: 2048 and 1), ``pids_limit``, ``metadata`` (a
JSON object merged into the session's metadata), ``group`` (the session's routing group; ``{task}`` in it
is the task's name), ``exec_timeout_sec`` (for an exec Harbor gives no
timeout: 3600, the gateway's most). The checkpoint policy itself is the gateway's
(``belayer serve --checkpoint-policy``).

Not supported: docker-compose tasks, host mounts (``--mounts``), GPUs, network allowlists, Windows
images. With a separate verifier environment (``tests/Dockerfile``), the verifier runs in a second
session of its own, and the agent's session is closed before the verdict: it gets no reward.

Its modules: `environment` (the environment and terminus-2), `gateway` (the sessions API client),
`images` (the task's image on the Docker engine). Harbor's import path names the package, so the names it
loads are imported here.
"""

from __future__ import annotations

from .environment import BelayerEnvironment, BelayerTerminus2, exec_script
from .images import base_images

__all__ = ["BelayerEnvironment", "BelayerTerminus2", "base_images", "exec_script"]
