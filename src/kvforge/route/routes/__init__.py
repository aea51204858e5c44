"""The router's routes, one router per concern; the proxy last (its catch-all forwards any other path)."""

from kvforge.route.routes import documents, info, proxy

ROUTERS = (documents.router, info.router, proxy.router)

__all__ = ["ROUTERS"]
