"""kernels/compile_progress.py: numba's compilations counted on stderr while a block runs,
nothing shown when everything comes from the cache (or was compiled before)."""

from __future__ import annotations

import io
import threading

import numba
import pytest

from hybridmoe.kernels.compile_progress import DESCRIPTION, compile_progress


def _fresh_function():
    """A new, uncompiled njit function calling another (two compilations on its first call)."""

    @numba.njit
    def inner(x):
        return x + 1

    @numba.njit
    def outer(x):
        return inner(x) * 2

    return outer


def test_a_compilation_shows_the_counter_and_a_compiled_function_nothing():
    fn, shown = _fresh_function(), io.StringIO()
    with compile_progress(file=shown) as counter:
        assert fn(1) == 4
    assert counter.compiled == 2  # outer and the inner function it calls
    assert DESCRIPTION in shown.getvalue() and "2 functions" in shown.getvalue()
    again = io.StringIO()
    with compile_progress(file=again) as counter:
        assert fn(2) == 6  # compiled already: no event
    assert counter.compiled == 0 and again.getvalue() == ""


def test_disabled_shows_nothing():
    shown = io.StringIO()
    with compile_progress(enabled=False, file=shown) as counter:
        assert _fresh_function()(1) == 4
    assert counter.compiled == 0 and shown.getvalue() == ""


def test_a_block_inside_another_counts_on_the_outer_counter():
    outer_file, inner_file = io.StringIO(), io.StringIO()
    with compile_progress(file=outer_file) as outer:
        with compile_progress(file=inner_file) as inner:
            assert inner is outer
            _fresh_function()(1)
        _fresh_function()(1)
    assert outer.compiled == 4 and inner_file.getvalue() == ""
    assert "4 functions" in outer_file.getvalue()
    with compile_progress(file=io.StringIO()) as after:  # the outer block closed: a new counter
        assert after is not outer


def test_a_compilation_on_another_thread_counts():
    fn, shown = _fresh_function(), io.StringIO()
    with compile_progress(file=shown) as counter:
        worker = threading.Thread(target=fn, args=(1,))
        worker.start()
        worker.join()
    assert counter.compiled == 2 and DESCRIPTION in shown.getvalue()


def test_a_failing_compilation_closes_the_counter_and_raises():
    @numba.njit
    def broken(x):
        return x.no_such_attribute

    shown = io.StringIO()
    with pytest.raises(numba.core.errors.TypingError):
        with compile_progress(file=shown) as counter:
            broken(1)
    assert DESCRIPTION in shown.getvalue() and counter.bar.disable  # closed
    with compile_progress(file=io.StringIO()) as after:  # nothing left open: a new counter
        assert after is not counter
