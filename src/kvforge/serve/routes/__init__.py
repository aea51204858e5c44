"""The server's routes, one router per concern: generations, stored documents, health/metrics/models."""

from kvforge.serve.routes import documents, generate, info

ROUTERS = (generate.router, documents.router, info.router)

__all__ = ["ROUTERS"]
