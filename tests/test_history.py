"""History keys (`kvbridge.history`): what makes two requests share a key, and which keys a
lease is granted with."""

from __future__ import annotations

from typing import Any

from kvbridge import history


def chat(*contents: str, **extra: Any) -> dict[str, Any]:
    roles = ("user", "assistant")
    return {"model": "m", "messages": [{"role": roles[i % 2], "content": c}
                                       for i, c in enumerate(contents)], **extra}


def test_a_longer_history_shares_the_keys_of_its_prefix() -> None:
    short = history.request_keys("t", chat("a", "b"), True)
    long = history.request_keys("t", chat("a", "b", "c", "d"), True)
    assert short is not None and long is not None
    assert len(short) == 2 and len(long) == 4
    assert long[:2] == short and len(set(long)) == 4
    assert all(len(k) == history.KEY_SIZE for k in long)


def test_a_changed_message_changes_its_key_and_every_later_one() -> None:
    one = history.request_keys("t", chat("a", "b", "c"), True)
    two = history.request_keys("t", chat("a", "B", "c"), True)
    assert one is not None and two is not None
    assert one[0] == two[0] and one[1] != two[1] and one[2] != two[2]


def test_tenant_model_endpoint_and_tools_root_the_keys() -> None:
    base = history.request_keys("t", chat("a"), True)
    assert base != history.request_keys("u", chat("a"), True)
    assert base != history.request_keys("t", {**chat("a"), "model": "m2"}, True)
    assert base != history.request_keys("t", chat("a", tools=[{"type": "function"}]), True)
    assert base != history.request_keys("t", chat("a", cache_salt="s1"), True)
    assert (history.request_keys("t", {"model": "m", "prompt": "x" * 600}, False)
            != history.request_keys("t", {"model": "m", "prompt": "x" * 600,
                                          "cache_salt": "s1"}, False))
    # Sampling settings do not shape the prompt: same keys.
    assert base == history.request_keys("t", chat("a", temperature=0.3, max_tokens=9), True)


def test_plain_and_other_message_forms_never_collide() -> None:
    plain = history.request_keys("t", {"model": "m", "messages": [
        {"role": "user", "content": "x"}]}, True)
    named = history.request_keys("t", {"model": "m", "messages": [
        {"role": "user", "content": "x", "name": "bob"}]}, True)
    parts = history.request_keys("t", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x"}]}]}, True)
    assert plain is not None and named is not None and parts is not None
    assert len({plain[0], named[0], parts[0]}) == 3
    # Key order inside a message does not matter (the JSON form is canonical).
    reordered = history.request_keys("t", {"model": "m", "messages": [
        {"name": "bob", "content": "x", "role": "user"}]}, True)
    assert reordered == named


def test_unrecognised_histories_get_no_keys() -> None:
    image = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    assert history.request_keys("t", image, True) is None
    assert history.request_keys("t", {"model": "m", "prompt": {"x": 1}}, False) is None
    assert history.request_keys("t", {"prompt": "x"}, False) is None  # no model
    many = {"model": "m", "messages": [{"role": "user", "content": "x"}]
            * (history.MAX_BOUNDARIES + 1)}
    assert history.request_keys("t", many, True) is None  # too long to key on the event loop


def test_completion_prompts_are_keyed_by_whole_chunks() -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(3 * history.CHUNK_CHARS + 10))
    keys = history.request_keys("t", {"model": "m", "prompt": text}, False)
    assert keys is not None and len(keys) == 3
    longer = history.request_keys("t", {"model": "m", "prompt": text + "z" * 600}, False)
    assert longer is not None and longer[:3] == keys and len(longer) == 4
    assert history.request_keys("t", {"model": "m", "prompt": "short"}, False) == []
    ids = list(range(2 * history.CHUNK_TOKENS + 5))
    token_keys = history.request_keys("t", {"model": "m", "prompt": ids}, False)
    assert token_keys is not None and len(token_keys) == 2
    assert token_keys[0] != keys[0]  # text and token prompts never share keys


def test_grant_keys_keep_the_last_boundaries_then_fewer_further_back() -> None:
    keys = [bytes([i]) * 16 for i in range(1, 201)]  # boundary c has key bytes([c])*16
    chosen = history.split(history.grant_keys(keys))
    counts = [k[0] for k in chosen]
    assert counts == [1, 72, 136, 168, 184, 192, 196, 198, 199, 200]
    assert history.split(history.grant_keys(keys[:1])) == keys[:1]
    assert history.grant_keys([]) == b""
    assert [k[0] for k in history.split(history.grant_keys(keys, most=4))] == [1, 198, 199, 200]
