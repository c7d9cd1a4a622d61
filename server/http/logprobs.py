"""Log-probabilities in the two shapes OpenAI uses: chat's ``content`` list and the legacy
completions' parallel lists.

Example (a stand-in tokenizer whose tokens are letters):
    >>> class Letters:
    ...     def decode(self, ids): return "".join(chr(97 + i) for i in ids)
    >>> from kvserve.server.engine.request import TokenLogprob
    >>> fmt = LogprobFormat(Letters())
    >>> fmt.chat([TokenLogprob(0, -0.5, ((0, -0.5), (1, -1.0)))])["content"][0]["top_logprobs"][1]
    {'token': 'b', 'logprob': -1.0, 'bytes': [98]}
    >>> fmt.legacy([TokenLogprob(0, -0.5, ((0, -0.5),)), TokenLogprob(1, -2.0, ((1, -2.0),))], 3)
    {'tokens': ['a', 'b'], 'token_logprobs': [-0.5, -2.0], 'top_logprobs': [{'a': -0.5}, {'b': -2.0}], 'text_offset': [3, 4]}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.server.engine.request import TokenLogprob


class LogprobFormat:
    """Turns engine ``TokenLogprob`` records into OpenAI JSON with the served tokenizer."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def token_text(self, token: int) -> str:
        # A token alone may be part of a UTF-8 character; the replacement char then shows.
        if token not in self._text:
            self._text[token] = self._tokenizer.decode([token])
        return self._text[token]

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, records: Sequence[TokenLogprob]) -> dict:
        content = []
        for r in records:
            entry = self._entry(r.token, r.logprob)
            entry["top_logprobs"] = [self._entry(t, lp) for t, lp in r.top]
            content.append(entry)
        return {"content": content, "refusal": None}

    def legacy(self, records: Sequence[TokenLogprob], offset: int) -> dict:
        """``offset``: characters of text before the first of these tokens."""
        tokens, offsets = [], []
        for r in records:
            offsets.append(offset)
            tokens.append(self.token_text(r.token))
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
                "top_logprobs": [{self.token_text(t): lp for t, lp in r.top} for r in records],
                "text_offset": offsets}
