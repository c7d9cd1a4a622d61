"""Stop strings across token boundaries and the detokenizer hand-off, with exact text."""

import pytest

from kvserve.server.engine.output import OutputState, StopMatcher


@pytest.mark.parametrize(
    "pieces, stops, emitted, stopped",
    [
        (["Hello", " wor", "ld"], ("\n",), "Hello world", False),
        (["ok E", "ND!"], ("END",), "ok ", True),
        (["a", "b", "c"], ("bc",), "a", True),
        (["x<", "/s", ">tail"], ("</s>",), "x", True),
        (["EN", "D"], ("ENX",), "END", False),  # a partial match that fails is released
        (["ab"], ("b", "ab"), "", True),  # the earliest stop wins
        (["é", "t", "é"], ("té",), "é", True),
    ],
)
def test_stop_matcher(pieces, stops, emitted, stopped):
    m = StopMatcher(stops)
    out, hit = [], False
    for piece in pieces:
        text, hit = m.feed(piece)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    assert ("".join(out), hit) == (emitted, stopped)


def test_holds_back_only_possible_prefixes():
    m = StopMatcher(("STOP",))
    assert m.feed("abcST") == ("abc", False)
    assert m.feed("x") == ("STx", False)


class _Detok:
    """A detokenizer over a fixed id -> text table, shaped like mlx-lm's."""

    def __init__(self, table):
        self.table, self.text, self.offset = table, "", 0

    def add_token(self, token):
        self.text += self.table[token]

    def finalize(self):
        pass

    @property
    def last_segment(self):
        seg, self.offset = self.text[self.offset:], len(self.text)
        return seg


def test_output_state_eos_and_finish():
    state = OutputState(_Detok({5: "Hi", 6: " the", 7: "re"}), StopMatcher(("there",)), frozenset({2}))
    assert state.add_token(5) == ("Hi", False)
    assert state.add_token(6) == (" ", False)  # " the" may begin "there"
    assert state.add_token(2) == ("the", True)  # end of sequence releases held text
    assert state.token_ids == [5, 6]
