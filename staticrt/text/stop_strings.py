"""Stop strings found in text that arrives a few characters at a time, in time linear in the text.

A server checks its stop strings after every token, on the one thread that steps every row: a
check that rescans the whole text, or tries every prefix of a long stop string, costs that thread
the text's or the string's length squared, per token, for every row. Here each stop string keeps
a Knuth-Morris-Pratt automaton: `state` is the length of the longest prefix of the string that
the text read so far ends with. A character moves it in amortised constant time; a full match is
the stop; and the state is also how much text must be held back, since it may begin the string.

Worked example: stop "abab", text arriving as "xab", "a", "b".
  after "xab": state 2 ("ab" is a prefix of "abab"): hold back 2 characters, send "x"
  after "a":   state 3 ("aba"): hold back 3, send nothing new
  after "b":   state 4: a match ending at character 5, starting at 5 - 4 + 1 = 2; the text is cut there.
"""

from __future__ import annotations

from collections.abc import Sequence


def _failure(pattern: str) -> list[int]:
    """KMP's failure function: fail[i] = the longest proper prefix of pattern[:i + 1] that is also its suffix."""
    fail, k = [0] * len(pattern), 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopStrings:
    """The stop strings of one request, matched against its text as it grows."""

    def __init__(self, stops: Sequence[str]) -> None:
        assert all(stops), "a stop string is never empty"
        self.stops = tuple(stops)
        self.fail = [_failure(s) for s in self.stops]
        self.state = [0] * len(self.stops)
        self.read = 0  # characters fed so far

    def feed(self, text: str) -> int | None:
        """Read `text`, the characters after those fed before; where the earliest stop string
        found starts (an index into all the text fed), or None. Among strings that complete in
        this piece, the one that starts first wins, as `min(text.find(s))` would pick."""
        cut = None
        for n, (stop, fail) in enumerate(zip(self.stops, self.fail)):
            k = self.state[n]
            for i, char in enumerate(text):
                while k and (k == len(stop) or stop[k] != char):
                    k = fail[k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop):
                    start = self.read + i + 1 - len(stop)
                    cut = start if cut is None else min(cut, start)
                    break
            self.state[n] = k
        self.read += len(text)
        return cut

    @property
    def held(self) -> int:
        """Characters at the end of the text that may begin a stop string: sent only once the
        next characters show they do not."""
        return max((k for k, stop in zip(self.state, self.stops) if k < len(stop)), default=0)
