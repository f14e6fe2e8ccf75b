"""History keys: how a turn that names no conversation finds the lease of the turn before it.

A key stands for a request's history up to one boundary: for a chat request, up to and
including one message; for a completion, up to a multiple of `CHUNK_CHARS` characters (or
`CHUNK_TOKENS` token ids) of its prompt. Keys are chained (each covers every segment before
it), 16 bytes, and rooted in the tenant, the model, the endpoint and whatever else shapes the
whole prompt (tools, a chat template), so that two histories share a key only when they share
everything up to it. The gateway derives them from the request exactly as the client sent it,
for the turn that makes a lease and for the turn that reads it, so nothing is tokenized twice:
the prefill connector's per-block hashes still decide which KV is reused, and a key only
proposes a candidate lease.

A turn's lease is granted with a few of its keys (`grant_keys`): its last boundaries, then fewer
further back. A later request sends all of its keys; the registry answers with the tenant's
active lease under the longest one that is indexed (`PinLeaseRequest.history_keys`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Sequence
from typing import Any

KEY_SIZE = 16
CHUNK_CHARS = 512
CHUNK_TOKENS = 64
_VERSION = b"kvbridge-history-v1"
# Request fields that shape the whole chat prompt (the template's preamble), besides messages,
# and vLLM's cache_salt (prompts under different salts must never share KV, nor match here).
_CHAT_ROOT_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "documents", "cache_salt")
# Most boundaries a request is keyed at: past it the history is not recognised (served without
# reuse), so that one request cannot hold the gateway's event loop for long.
MAX_BOUNDARIES = 16384


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=True).encode("utf-8", "surrogatepass")


def _message(message: dict[str, Any]) -> bytes:
    """A chat message as one segment: a plain `{"role", "content"}` message (most of a long
    history) as its two strings, cheaply; any other as canonical JSON. The leading tag keeps
    the two forms apart."""
    if len(message) == 2:
        role, content = message.get("role"), message.get("content")
        if type(role) is str and type(content) is str:
            name = role.encode("utf-8", "surrogatepass")
            return (b"\x01" + len(name).to_bytes(4, "little") + name
                    + content.encode("utf-8", "surrogatepass"))
    return b"\x02" + _canonical(message)


def _chain(root: bytes, segments: Sequence[bytes]) -> list[bytes]:
    keys = []
    key = root
    for segment in segments:
        h = hashlib.blake2b(key, digest_size=KEY_SIZE)
        h.update(len(segment).to_bytes(8, "little"))
        h.update(segment)
        key = h.digest()
        keys.append(key)
    return keys


def _root(tenant: str, model: str, endpoint: str, extras: bytes) -> bytes:
    h = hashlib.blake2b(_VERSION, digest_size=KEY_SIZE)
    for part in (tenant.encode(), model.encode(), endpoint.encode(), extras):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def _text_only(message: dict[str, Any]) -> bool:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return True
    return all(isinstance(p, dict) and p.get("type", "text") == "text" for p in content)


def request_keys(tenant: str, body: dict[str, Any], chat: bool) -> list[bytes] | None:
    """The request's history key at each of its boundaries, shortest prefix first; None when
    its history cannot be recognised (multimodal parts, a prompt of another shape): the turn
    is then served without reuse. `body` is a checked turn body (`check_turn_body`)."""
    model = body.get("model")
    if not isinstance(model, str):
        return None
    try:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or len(messages) > MAX_BOUNDARIES or not all(
                    isinstance(m, dict) and _text_only(m) for m in messages):
                return None
            extras = _canonical({k: body[k] for k in _CHAT_ROOT_FIELDS if k in body})
            return _chain(_root(tenant, model, "chat", extras),
                          [_message(m) for m in messages])
        prompt = body.get("prompt")
        salt = _canonical(body.get("cache_salt"))
        if isinstance(prompt, str):
            if len(prompt) // CHUNK_CHARS > MAX_BOUNDARIES:
                return None
            # Whole characters per chunk: cut the text, not its bytes.
            chunks = [prompt[i:i + CHUNK_CHARS].encode("utf-8", "surrogatepass")
                      for i in range(0, len(prompt) - CHUNK_CHARS + 1, CHUNK_CHARS)]
            return _chain(_root(tenant, model, "text", salt), chunks)
        if (isinstance(prompt, list) and prompt
                and len(prompt) // CHUNK_TOKENS <= MAX_BOUNDARIES
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            ids = array("q", prompt)
            if sys.byteorder != "little":  # the same keys on every gateway's host
                ids.byteswap()
            data = ids.tobytes()
            step = 8 * CHUNK_TOKENS
            chunks = [data[i:i + step] for i in range(0, len(data) - step + 1, step)]
            return _chain(_root(tenant, model, "tokens", salt), chunks)
    except (TypeError, ValueError, OverflowError, RecursionError):  # not JSON-able, huge ids
        return None
    return None


def grant_keys(keys: Sequence[bytes], most: int = 16) -> bytes:
    """The keys a turn's lease is granted with, concatenated, shortest prefix first: the
    prompt's last three boundaries, then boundaries 4, 8, 16, ... back from its end, and its
    first (a system prompt that other conversations share), at most `most` in all. Enough for
    the turn that continues the lease (its last key) and for branches off its recent history;
    a branch from further back finds it at the boundary below, and the connector's block
    hashes then reuse all that matches."""
    n = len(keys)
    if n == 0:
        return b""
    counts = {n, n - 1, n - 2, 1}
    back = 4
    while back < n:
        counts.add(n - back)
        back *= 2
    chosen = sorted(c for c in counts if c >= 1)
    if len(chosen) > most:  # keep the first and the latest
        chosen = chosen[:1] + chosen[-(most - 1):]
    return b"".join(keys[c - 1] for c in chosen)


def join(keys: Sequence[bytes]) -> bytes:
    return b"".join(keys)


def split(data: bytes) -> list[bytes]:
    return [data[i:i + KEY_SIZE] for i in range(0, len(data), KEY_SIZE)]
