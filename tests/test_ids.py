"""Derived ids: a retried request must find what its first attempt made, on any replica of any
version that shares the state."""

from __future__ import annotations

import hashlib

from kvbridge import ids


def test_pin_ids_are_the_keyed_hash_every_replica_version_makes() -> None:
    # Redis replicas of different versions share pins: the id is the 8-byte BLAKE2b of
    # "tenant NUL reader NUL request", keyed with the shared secret, in hex after "p-".
    secret = b"s" * 16
    make = ids.pin_id_maker(secret)
    want = "p-" + hashlib.blake2b(b"acme\x00prefill-0\x00req-1", digest_size=8,
                                  key=secret).hexdigest()
    assert make("acme", "prefill-0", "req-1") == want
    assert make("acme", "prefill-0", "req-1") == want  # the keyed state is copied, not used up


def test_pin_ids_differ_by_secret_tenant_reader_and_request() -> None:
    a, b = ids.pin_id_maker(b"a" * 16), ids.pin_id_maker(b"b" * 16)
    base = a("t", "r", "q")
    assert b("t", "r", "q") != base
    assert {a("t2", "r", "q"), a("t", "r2", "q"), a("t", "r", "q2")}.isdisjoint({base})
    # the separators keep ("ab", "c") and ("a", "bc") apart
    assert a("ab", "c", "q") != a("a", "bc", "q")


def test_grant_lease_ids_are_stable() -> None:
    assert ids.grant_lease_id("h", "r") == ids.grant_lease_id("h", "r")
    assert ids.grant_lease_id("h", "r") != ids.grant_lease_id("h2", "r")
    assert ids.grant_lease_id("h", "r").startswith("l-")
