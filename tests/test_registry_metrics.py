"""The registry's lock-free per-RPC metrics export what prometheus_client's own would, and the
fast path of the identifier check accepts exactly what its pattern does."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.errors import InvalidArgument
from kvbridge.services.registry import _validate
from kvbridge.services.registry._metrics import LoopCounter, LoopHistogram

BUCKETS = (0.0001, 0.00025, 0.001, 0.01, 1.0)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


@given(st.lists(st.tuples(st.sampled_from(["A", "B"]),
                          st.one_of(st.sampled_from([0.0, *BUCKETS, 2.0]),
                                    st.floats(0.0, 5.0))), max_size=60))
def test_loop_histogram_exports_what_prometheus_histogram_does(
        observations: list[tuple[str, float]]) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("x_seconds", "doc", ["method"], buckets=BUCKETS, registry=theirs)
    loop = LoopHistogram("x_seconds", "doc", "method", BUCKETS)
    ours.register(loop)
    for method, seconds in observations:
        reference.labels(method).observe(seconds)
        loop.labels(method).observe(seconds)
    expected, got = _samples(theirs), _samples(ours)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key


def test_loop_counter_exports_what_prometheus_counter_does() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Counter("reads", "doc", ["outcome"], registry=theirs)
    loop = LoopCounter("reads", "doc", "outcome", ["hit", "no_lease"])
    ours.register(loop)
    for outcome in ("hit", "no_lease"):
        reference.labels(outcome)  # a labelled child exists from the start, at 0
    for outcome in ("hit", "hit", "no_lease", "hit"):
        reference.labels(outcome).inc()
        loop.counts[outcome] += 1
    assert _samples(ours) == _samples(theirs)
    assert _samples(ours)[("reads_total", (("outcome", "hit"),))] == 3


_ID = re.compile(r"[\x21-\x7e]+")


def _accepted(value: str, max_length: int = 8) -> bool:
    try:
        _validate.identifier("f", value, max_length)
    except InvalidArgument:
        return False
    return True


def test_identifier_fast_path_is_the_pattern_for_every_character() -> None:
    for code in range(0x3000):
        c = chr(code)
        assert _accepted(c) == (_ID.fullmatch(c) is not None), hex(code)
        assert _accepted("ab" + c) == (_ID.fullmatch("ab" + c) is not None), hex(code)


@given(st.text(max_size=12))
def test_identifier_accepts_exactly_short_printable_ascii(value: str) -> None:
    assert _accepted(value) == (0 < len(value) <= 8 and _ID.fullmatch(value) is not None)


@pytest.mark.parametrize(("value", "message"), [
    ("", "is required"), ("x" * 9, "longer than 8"), ("a b", "printable ASCII"),
    ("caf\u00e9", "printable ASCII")])
def test_identifier_errors_name_the_problem(value: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        _validate.identifier("f", value, 8)
