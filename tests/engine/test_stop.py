"""Stop strings over streamed deltas: split matches, earliest wins, hold-back and release."""

import pytest

from localllm.engine.sampling.stop import StopChecker


def _feed(checker: StopChecker, deltas: list[str]) -> tuple[str, str | None, list[str]]:
    """All emitted text, the match, and what each add() returned."""
    pieces, matched = [], None
    for d in deltas:
        out, m = checker.add(d)
        pieces.append(out)
        matched = matched or m
    if matched is None:
        pieces.append(checker.flush())
    return "".join(pieces), matched, pieces


def _every_split(text: str):
    """Every way of cutting text into 1-3 deltas."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
        for j in range(i + 1, len(text)):
            yield [text[:i], text[i:j], text[j:]]


def test_stop_split_across_two_and_three_deltas():
    text = "Hello END world"
    for deltas in _every_split(text):
        assert _feed(StopChecker(["END"]), deltas)[:2] == ("Hello ", "END")
    got = _feed(StopChecker(["END"]), ["Hello E", "N", "D world"])
    assert got[2] == ["Hello ", "", ""]  # "E", then "EN" held back, never half-emitted


def test_include_stop():
    for deltas in _every_split("ab<|x|>cd"):
        assert _feed(StopChecker(["<|x|>"], include_stop=True), deltas)[:2] == ("ab<|x|>", "<|x|>")


def test_earliest_match_wins_whatever_the_chunking():
    # "bc" completes before "abcd" does; "xyz" starts later
    for deltas in _every_split("zabcdxyz"):
        assert _feed(StopChecker(["xyz", "abcd", "bc"]), deltas)[:2] == ("za", "bc")
    # same end: the one that starts first, so no part of a stop string leaks
    assert _feed(StopChecker(["bc", "abc"]), ["xabc"])[:2] == ("x", "abc")
    assert _feed(StopChecker(["two", "one"]), ["a one two"])[:2] == ("a ", "one")


def test_partial_that_is_not_a_stop_is_released():
    c = StopChecker(["STOP"])
    assert c.add("ab ST") == ("ab ", None)
    assert c.add("O") == ("", None)
    assert c.add("P!") == ("", "STOP")

    c = StopChecker(["STOP"])
    assert c.add("ab ST") == ("ab ", None)
    assert c.add("ART") == ("START", None)  # not a stop after all: released
    assert c.add(" S") == (" ", None)
    assert c.add("TX") == ("STX", None)  # only a tail that can still grow into "STOP" is held
    assert c.add("SX") == ("SX", None)
    assert c.add("STO") == ("", None)
    assert c.flush() == "STO"


def test_overlapping_prefix_is_rechecked():
    # "aab": the held "aa" is not a prefix match itself, but its tail "a" is
    for deltas in _every_split("xaaab"):
        assert _feed(StopChecker(["aab"]), deltas)[:2] == ("xa", "aab")


def test_nothing_after_a_match():
    c = StopChecker(["."])
    assert c.add("Hi. More") == ("Hi", ".")
    assert c.add(" text") == ("", None)
    assert c.flush() == ""


def test_unicode():
    for deltas in _every_split("héllo→終わり!"):
        assert _feed(StopChecker(["終わ"]), deltas)[:2] == ("héllo→", "終わ")
    assert _feed(StopChecker(["🙂"], include_stop=True), ["ok 🙂 bye"])[:2] == ("ok 🙂", "🙂")


def test_no_stop_strings_pass_through():
    c = StopChecker([])
    assert c.add("abc") == ("abc", None)
    assert c.flush() == ""


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError):
        StopChecker(["ok", ""])
