"""`clora trainapi`: the Tinker-compatible API as a process of its own.

    main(TrainApiSettings(), redis_url="redis://host:6379/0")

Serves `create_app` with uvicorn on `settings.host:settings.port` until SIGTERM/SIGINT. Tinker
keys are checked against the registry (`Registry.authenticate_tinker`); requests reach the
learner through Redis, so this process holds no model and restarts in a second.
"""

from __future__ import annotations

from fastapi import FastAPI

from clora.storage import StorageSettings
from clora.trainapi.app import create_app
from clora.trainapi.settings import TrainApiSettings


def build(settings: TrainApiSettings, redis_url: str) -> FastAPI:
    """The app wired to the registry and the learner's queue in Redis."""
    import redis

    from clora.ingest.webhook import async_redis_client
    from clora.registry import Registry

    registry = Registry(redis.Redis.from_url(redis_url))
    return create_app(settings, registry.authenticate_tinker, async_redis_client(redis_url), StorageSettings())


def main(settings: TrainApiSettings, redis_url: str) -> None:
    """Serve until SIGTERM/SIGINT (uvicorn handles both)."""
    import uvicorn

    from clora.settings import HTTP_KEEP_ALIVE_S

    # keep-alive above the clients' idle pools, so a reused connection never meets a server close
    uvicorn.run(build(settings, redis_url), host=settings.host, port=settings.port, log_level="info",
                access_log=False, timeout_keep_alive=HTTP_KEEP_ALIVE_S)
