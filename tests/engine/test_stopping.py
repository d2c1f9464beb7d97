"""Stop strings over streamed text deltas."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.engine.stopping import StopStringMatcher


def stream(stop: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    """Feed every delta, flush if no stop; return (all emitted text, stopped, per-feed emits)."""
    matcher = StopStringMatcher(stop)
    emits = []
    for delta in deltas:
        out, stopped = matcher.feed(delta)
        emits.append(out)
        if stopped:
            return "".join(emits), True, emits
    return "".join(emits) + matcher.flush(), False, emits


def reference_cut(text: str, stop: list[str]) -> tuple[str, bool]:
    """Text before the stop string that completes first (the longest one if several do)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stop if text.endswith(s, 0, end)]
        if starts:
            return text[: min(starts)], True
    return text, False


def test_no_stop_strings_pass_deltas_straight_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("Hello <") == ("Hello <", False)
    assert matcher.flush() == ""


def test_stop_string_split_across_many_deltas():
    text, stopped, emits = stream(["</s>"], ["Hello <", "/", "s", ">", " never"])
    assert (text, stopped) == ("Hello ", True)
    assert emits == ["Hello ", "", "", ""]


def test_partial_prefix_then_mismatch_releases_held_text():
    matcher = StopStringMatcher(["</s>"])
    assert matcher.feed("ab</") == ("ab", False)
    assert matcher.feed("x") == ("</x", False)
    assert matcher.feed("<") == ("", False)
    assert matcher.flush() == "<"


def test_flush_at_end_of_generation_releases_held_text():
    text, stopped, _ = stream(["STOP"], ["all done ST"])
    assert (text, stopped) == ("all done ST", False)


def test_multiple_stop_strings_first_one_wins():
    assert stream(["STOP", "END"], ["xxEN", "Dyy", "STOP"])[:2] == ("xx", True)
    assert stream(["STOP", "END"], ["xxSTO", "P yy END"])[:2] == ("xx", True)


def test_stop_string_overlapping_itself():
    # "aa" is held after "aaa" because it may still start "aab".
    _, _, emits = stream(["aab"], ["aa", "a", "b"])
    assert emits == ["", "a", ""]
    assert stream(["aab"], ["aaab"])[:2] == ("a", True)


def test_stop_strings_overlapping_each_other():
    # "bc" completes before "abcd" could, so it decides, however the text is split.
    assert stream(["abcd", "bc"], ["abcd"])[:2] == ("a", True)
    assert stream(["abcd", "bc"], ["ab", "cd"])[:2] == ("a", True)
    # Two stop strings completing on the same character: the longer (earlier) one wins.
    assert stream(["bc", "abc"], ["xab", "c"])[:2] == ("x", True)


def test_after_a_stop_nothing_more_is_emitted():
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("line\n\nmore") == ("line", True)
    assert matcher.stopped
    assert matcher.feed("even more") == ("", True)
    assert matcher.flush() == ""


@pytest.mark.parametrize(
    ("stop", "message"),
    [([""], "non-empty"), ([None], "non-empty strings"), ("</s>", "list of strings")],
)
def test_invalid_stop_strings_are_rejected(stop, message):
    with pytest.raises(ValueError, match=message):
        StopStringMatcher(stop)


def chunked(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


ALPHABET = "ab</>"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=30),
    stop=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 1000), max_size=12),
)
def test_any_chunking_emits_the_text_before_the_first_stop(text, stop, cuts):
    assert stream(stop, chunked(text, cuts))[:2] == reference_cut(text, stop)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=30),
    stop=st.text(ALPHABET, min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 1000), max_size=12),
)
def test_single_stop_string_cuts_at_its_first_occurrence(text, stop, cuts):
    index = text.find(stop)
    expected = (text, False) if index < 0 else (text[:index], True)
    assert stream([stop], chunked(text, cuts))[:2] == expected
