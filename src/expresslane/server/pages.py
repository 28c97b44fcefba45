"""What a browser gets besides the API: the playground at `/` (plain HTML, CSS and JavaScript
shipped in `assets/playground/`, no CDN) and `/playground/info`, what the page needs to know:
the model, the tiers and their price multipliers, the base prices."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from expresslane.server.state import get_state

PLAYGROUND_DIR = Path(__file__).resolve().parent.parent / "assets" / "playground"
# response headers a page on another origin may read (rate limits, retry delays, the id)
EXPOSED_HEADERS = [
    "x-request-id",
    "retry-after",
    "retry-after-ms",
    "x-should-retry",
    "x-ratelimit-limit-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-requests",
    "x-ratelimit-reset-tokens",
]


def cors_options(origins: list[str]) -> dict:
    """Starlette's CORSMiddleware options for `allowed_origins`: keys travel in the
    Authorization header, never in cookies, so credentials stay off."""
    return dict(
        allow_origins=origins,
        allow_methods=["*"],
        allow_headers=["*"],
        expose_headers=EXPOSED_HEADERS,
        allow_credentials=False,
        max_age=600,
    )


def install_pages(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(PLAYGROUND_DIR / "index.html")

    @app.get("/playground/info", include_in_schema=False)
    async def playground_info(request: Request):
        state = get_state(request)
        lanes = state.accounts.lanes
        return {
            "model": state.model_name,
            "tiers": [
                {
                    "name": lane.name,
                    "enabled": lane.enabled,
                    "price_multiplier": lane.price_multiplier,
                    "max_batch": lane.max_batch,
                }
                for lane in sorted(lanes.values(), key=lambda lane: lane.rank)
            ],
            "prices": asdict(state.accounts.prices),
        }

    app.mount("/playground", StaticFiles(directory=PLAYGROUND_DIR), name="playground")
