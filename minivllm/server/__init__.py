"""An OpenAI-compatible server for minivllm: ``minivllm serve`` (see :mod:`minivllm.server.api_server`).

FastAPI, uvicorn and prometheus-client are imported only when this package is.
"""

from minivllm.server.api_server import build_app, load_api_keys, load_tenants
from minivllm.server.async_engine import AsyncEngine, RequestStream
from minivllm.server.background import BackgroundServer, free_port

__all__ = ["AsyncEngine", "BackgroundServer", "RequestStream", "build_app", "free_port", "load_api_keys",
           "load_tenants"]
