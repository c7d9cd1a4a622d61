"""Anthropic's Messages API, served by the same engine as the OpenAI routes."""

from kvserve.server.http.anthropic.routes import install_anthropic_routes

__all__ = ["install_anthropic_routes"]
