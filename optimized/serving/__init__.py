"""Serving the optimized engine: video programs end to end (`optimized.programs`), `AsyncEngine` (the scheduler
on its own thread, asyncio API), the OpenAI-style HTTP server (`serve` extra), `fvgen`, and the DeploymentCard.
Importing this package loads no family module and no optional dependency."""

from optimized.serving.families import ServingError, attach_media, media_chain

__all__ = ["AsyncEngine", "ServingError", "attach_media", "media_chain"]


def __getattr__(name: str):
    if name == "AsyncEngine":
        from optimized.serving.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
