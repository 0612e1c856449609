"""Token strings of a tokenizer and a character trie over them, built once per tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..host_state import CacheSlot

if TYPE_CHECKING:
    from ..host_protocol import Host



@dataclass
class Vocab:
    """Token strings of one tokenizer, and a character trie over them (built once)."""

    strings: list[str | None]
    trie: list[Any]  # node = [children: dict[str, node], token ids ending here]
    safe_by_len: list[int]  # ids whose text may appear inside a JSON string, shortest first
    safe_lens: list[int]  # the length of each id in safe_by_len
    quoted: list[tuple[int, int, str]]  # (id, index of first '"', text) where the text before the quote is safe
    eos: list[int]


def is_safe_char(c: str) -> bool:
    return c != '"' and c != "\\" and c >= " " and c != "\x7f"


def _byte_decoder() -> dict[str, int]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_strings(tokenizer: Any) -> list[str | None]:
    """The exact text each token id adds to an output (``None``: special, or not whole UTF-8)."""
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {i for i, t in added.items() if getattr(t, "special", False)}
    byte_level = any(p and "Ġ" in p for p in pieces[:5000] if p)
    decoder = _byte_decoder() if byte_level else {}
    out: list[str | None] = []
    for tid, piece in enumerate(pieces):
        if piece is None or tid in special:
            out.append(None)
            continue
        if byte_level:
            try:
                text = bytes(decoder[c] for c in piece).decode("utf-8")
            except (KeyError, UnicodeDecodeError):
                text = None
        elif piece.startswith("<0x") and piece.endswith(">"):
            text = None  # a sentencepiece byte-fallback piece: part of a multi-byte character
        else:
            text = piece.replace("▁", " ")
        out.append(text or None)
    return out


def build_vocab(tokenizer: Any, eos: list[int]) -> Vocab:
    """Precompute what :class:`JsonConstraint` needs for one tokenizer."""
    strings = token_strings(tokenizer)
    root: list[Any] = [{}, []]
    safe: list[tuple[int, int]] = []
    quoted: list[tuple[int, int, str]] = []
    for tid, s in enumerate(strings):
        if not s:
            continue
        node = root
        for c in s:
            nxt = node[0].get(c)
            if nxt is None:
                nxt = node[0][c] = [{}, []]
            node = nxt
        node[1].append(tid)
        q = s.find('"')
        if q < 0:
            if all(is_safe_char(c) for c in s):
                safe.append((len(s), tid))
        elif all(is_safe_char(c) for c in s[:q]):
            quoted.append((tid, q, s))
    safe.sort()
    return Vocab(strings, root, [t for _, t in safe], [n for n, _ in safe], quoted, list(eos))


#: the builtin grammar engine's view of the tokenizer, per host
VOCAB: CacheSlot[Vocab] = CacheSlot("grammar vocabulary")


def vocab_for(host: Host) -> Vocab:
    """The :class:`Vocab` of the host's tokenizer, built on first use and cached on ``host.caches``."""
    return host.caches.get_or_make(VOCAB, lambda: _host_vocab(host))


def _host_vocab(host: Host) -> Vocab:
    eos = list(host.info.eos_token_ids) if host.info is not None else []
    if not eos and host.tokenizer.eos_token_id is not None:
        eos = [host.tokenizer.eos_token_id]
    return build_vocab(host.tokenizer, eos)
