"""OpenAI's Responses API (``POST /v1/responses``), served by the same engine as chat completions."""

from kvserve.server.http.responses.routes import install_responses_routes

__all__ = ["install_responses_routes"]
