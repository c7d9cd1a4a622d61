"""OpenAI's Responses API (``POST /v1/responses``), served by the same engine as chat completions,
and the responses it keeps (``GET``/``DELETE /v1/responses/{id}``, ``previous_response_id``)."""

from kvserve.server.http.responses.routes import install_responses_routes

__all__ = ["install_responses_routes"]
