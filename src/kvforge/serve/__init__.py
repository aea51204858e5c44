"""SERVE: an OpenAI-compatible HTTP server (FastAPI) around one :class:`~kvforge.engine.Engine`.

>>> from kvforge.serve import create_app            # doctest: +SKIP
>>> app = create_app(engine, model_name="smollm2-135m", reuse="prefix", store_url="file:///tmp/kv")
>>> uvicorn.run(app, host="127.0.0.1", port=8000)

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client).
"""

from kvforge.serve.app import create_app

__all__ = ["create_app"]
