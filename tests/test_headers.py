"""The header-name patterns (corral.balancer.headers) match exactly the names they are built from.

Why: the patterns are laid out as a trie for speed; a trie that lost a name, or matched a prefix
or an extension of one, would let a hop-by-hop header through or drop an end-to-end one.
"""

from __future__ import annotations

import itertools
import random

from corral.balancer import headers

SETS = [
    headers._REQUEST_DROP,
    headers.HOP_BY_HOP,
    frozenset({b"a", b"ab", b"abc", b"b", b"te", b"trailer"}),
]


def _names(pattern_names: frozenset[bytes], line_block: bytes) -> list[bytes]:
    return [m.group(1) for m in headers._pattern(pattern_names).finditer(line_block)]


def test_each_name_matches_and_no_prefix_or_extension_does() -> None:
    for names in SETS:
        for name in names:
            assert _names(names, b"\r\n" + name + b": v\r\n") == [name]
            for near in (name[:-1], name + b"x", b"x" + name):
                if near not in names:
                    assert _names(names, b"\r\n" + near + b": v\r\n") == []


def test_trie_finds_what_a_flat_alternation_finds() -> None:
    rng = random.Random(7)
    for names in SETS:
        pool = [*names, *(n[:-1] for n in names), *(n + b"-x" for n in names), b"accept", b""]
        for _ in range(3000):
            lines = (rng.choice(pool) + rng.choice([b":", b": v", b" :"]) for _ in range(4))
            block = b"".join(b"\r\n" + line for line in itertools.islice(lines, 4)) + b"\r\n"
            expected = []
            for line in block.split(b"\r\n")[1:]:
                name, colon, _ = line.partition(b":")
                if colon and name in names:
                    expected.append(name)
            assert _names(names, block) == expected


def test_a_last_line_without_its_crlf_is_read_not_looped_on() -> None:
    """The callers pass blocks that end with CRLF; one that does not must still end (it once
    searched again from the start, for ever)."""
    kept, found = headers.scan_response(
        b"\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked"
    )
    assert found[b"transfer-encoding"] == [b"chunked"]
    assert kept == b"\r\nContent-Type: text/plain"
    kept, found = headers.scan_request(b"\r\nHost: h\r\nX-A: 1\r\nConnection: close")
    assert found[b"host"] == [b"h"] and found[b"connection"] == [b"close"]
    assert kept == b"\r\nX-A: 1"
