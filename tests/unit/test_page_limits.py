"""The server-side checks pages run on what a browser sent (inspector.session.limits check_int, check_float,
check_chars) and on what a file holds (cut_text), with the messages written out by hand."""
from __future__ import annotations

import math

import pytest

from inspector.session.limits import LimitError, check_chars, check_float, check_int, cut_text


@pytest.mark.parametrize("value, words", [
    (21, "N must be between 2 and 20, got 21"),
    (-(10**12), "N must be between 2 and 20, got -1,000,000,000,000"),
    (2.5, "N must be a whole number, got 2.5"),
    (math.inf, "N must be a whole number, got inf"),
    (math.nan, "N must be a whole number, got nan"),
    (True, "N must be a whole number, got true/false"),
    ("![x](http://evil.example)", "N must be a whole number, got text"),      # never echoed into Markdown
    (None, "N must be a whole number, got nothing"),
])
def test_check_int_refuses(value, words):
    with pytest.raises(LimitError) as e:
        check_int(value, 2, 20, "N")
    assert str(e.value) == words


def test_check_int_accepts_whole_floats_as_ints():
    assert check_int(7.0, 2, 20, "N") == 7 and type(check_int(7.0, 2, 20, "N")) is int
    assert check_int(2, 2, 20, "N") == 2 and check_int(20, 2, 20, "N") == 20


@pytest.mark.parametrize("value, words", [
    (math.nan, "F must be a number, got NaN"),
    (math.inf, "F must be between 0 and 10, got inf"),
    (-0.5, "F must be between 0 and 10, got -0.5"),
    ("1", "F must be a number, got text"),
])
def test_check_float_refuses(value, words):
    with pytest.raises(LimitError) as e:
        check_float(value, 0.0, 10.0, "F")
    assert str(e.value) == words


def test_check_float_bounds_are_inclusive_and_infinity_allowed_when_asked():
    assert check_float(0, 0.0, 10.0, "F") == 0.0 and check_float(10.0, 0.0, 10.0, "F") == 10.0
    assert check_float(math.inf, 0.0, math.inf, "F") == math.inf


def test_check_chars():
    assert check_chars("a" * 200, 200, "Stages (glob)") == "a" * 200
    with pytest.raises(LimitError, match=r"^Stages \(glob\) is 201 characters long; this field takes at most 200$"):
        check_chars("a" * 201, 200, "Stages (glob)")
    with pytest.raises(LimitError, match=r"^Heads must be text, got list$"):
        check_chars(["0"], 200, "Heads")


def test_cut_text():
    assert cut_text("abc", 3) == ("abc", None)
    assert cut_text("abcdef", 4) == ("abcd", "only its first 4 of 6 characters are shown "
                                             "(LLM_INSPECTOR_MAX_PROMPT_CHARS)")
    assert cut_text(12345, 10) == ("12345", "it is not text (int); shown as written")
    assert cut_text(["x"] * 5, 6) == ("['x', ", "it is not text (list); shown as written; only its first 6 of 25 "
                                                "characters are shown (LLM_INSPECTOR_MAX_PROMPT_CHARS)")
