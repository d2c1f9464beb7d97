"""Stop strings over streamed text: emit what is safe, hold back what might become a stop."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Streaming stop-string detection over decoded text deltas.

    Generation stops at the first point in the stream where any stop string is complete; if
    several complete at that same character, the one starting earliest wins. The output is the
    text before that stop string, which is never emitted. The result does not depend on how the
    text is split into deltas. Text that could still grow into a stop string is held back until
    it is decided; `flush` releases it when generation ends for another reason.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            raise ValueError(f"stop must be a list of strings, got the string {stop!r}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._stops = tuple(dict.fromkeys(stop))  # de-duplicated, order kept
        self._max_prefix_len = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""  # never contains a complete stop string
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string has completed; later feeds emit nothing."""
        return self._stopped

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add newly decoded text; return (text safe to emit now, whether a stop completed).

        With no stop strings this is `(delta, False)`. After a stop it is `("", True)`.
        """
        if not self._stops:
            return delta, False
        if self._stopped:
            return "", True
        text = self._held + delta
        stop_start = self._first_stop_start(text)
        if stop_start is not None:
            self._held, self._stopped = "", True
            return text[:stop_start], True
        keep = self._longest_pending_suffix(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Release the held-back text at the end of generation (max tokens or EOS)."""
        held, self._held = self._held, ""
        return held

    def _first_stop_start(self, text: str) -> int | None:
        """Start of the stop string in `text` that ends first (then starts first), or None."""
        best: tuple[int, int] | None = None  # (end, start)
        for s in self._stops:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
        return None if best is None else best[1]

    def _longest_pending_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self._max_prefix_len), 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self._stops):
                return n
        return 0
