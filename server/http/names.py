"""Which model names a request may use, and the name its reply carries.

A server serves one model, under its own id and "default". Agent clients send the name
their configuration holds (Claude Code ``claude-sonnet-4-5-...`` and a small model's name for
side calls, llama.cpp's suites ``test``), so the operator can add names, shell-style
patterns allowed (``--served-model-name 'claude-*' test``, or ``'*'`` for any). A reply
carries the name its request used ("default" is answered with the model's id).

    >>> names = ModelNames("SmolLM2-135M-Instruct", ("claude-*", "test"))
    >>> names.check("claude-sonnet-4-5-20250929"), names.check("default"), names.check("test")
    ('claude-sonnet-4-5-20250929', 'SmolLM2-135M-Instruct', 'test')
    >>> names.check("gpt-4")
    Traceback (most recent call last):
    ...
    kvserve.server.http.errors.APIError: model 'gpt-4' is not served here; this server serves 'SmolLM2-135M-Instruct' (also as claude-*, test)
    >>> names.listed()
    ['SmolLM2-135M-Instruct', 'test']
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from kvserve.server.http.errors import APIError

_SHOWN = 64  # characters of an unknown name echoed back: never a megabyte


class ModelNames:
    def __init__(self, model_id: str, patterns: tuple[str, ...] = ()):
        self.model_id, self.patterns = model_id, tuple(patterns)

    def check(self, requested: str) -> str:
        """The name the reply carries; a 404 ``model_not_found`` for a name not served."""
        if requested == "default":
            return self.model_id
        if requested == self.model_id or any(fnmatchcase(requested, p) for p in self.patterns):
            return requested
        shown = requested if len(requested) <= _SHOWN else requested[:_SHOWN] + "..."
        also = f" (also as {', '.join(self.patterns)})" if self.patterns else ""
        raise APIError(404, f"model {shown!r} is not served here; this server serves '{self.model_id}'{also}",
                       param="model", code="model_not_found")

    def listed(self) -> list[str]:
        """The names ``/v1/models`` lists: the id, then each added name that is no pattern."""
        plain = [p for p in self.patterns if not any(c in p for c in "*?[") and p != self.model_id]
        return [self.model_id, *plain]
