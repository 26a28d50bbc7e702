"""An OpenAI-compatible server for minivllm: ``minivllm serve`` (see :mod:`minivllm.server.api_server`).

FastAPI, uvicorn and prometheus-client are imported only when this package is.
"""

from minivllm.server.api_server import build_app, load_api_keys
from minivllm.server.async_engine import AsyncEngine, RequestStream

__all__ = ["AsyncEngine", "RequestStream", "build_app", "load_api_keys"]
