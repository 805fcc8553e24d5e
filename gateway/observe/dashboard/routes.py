"""``GET /dashboard``: the operator's page, and ``/dashboard/static/...``: its scripts, styles and the
vendored chart library (uPlot, MIT, with its licence), all shipped in the package: no CDN, no build step.

The page is static and holds no data: its script reads ``/api/dashboard/state``, ``/api/sessions`` and
the live feed ``/api/events``, so the API token guards the data as for any other client (the page
takes the token from ``#token=...`` or asks for it). It uses URLs relative to the page, so a gateway
served under a path prefix works as well.

>>> [getattr(r, "path", "") for r in routes()]
['/dashboard', '/dashboard/', '/dashboard/static']
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"

# The page runs only its own scripts and talks only to its own origin; no other site may frame it.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


async def page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=_HEADERS)


async def with_slash(request: Request) -> Response:
    # The page's URLs are relative to /dashboard; under /dashboard/ they would miss by one level. A
    # relative redirect keeps any path prefix a proxy adds.
    return RedirectResponse("../dashboard", status_code=308)


def routes() -> list[Route | Mount]:
    """The dashboard's routes, for the app's route list."""
    return [
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/", with_slash, methods=["GET"]),
        Mount("/dashboard/static", app=StaticFiles(directory=STATIC), name="dashboard-static"),
    ]
