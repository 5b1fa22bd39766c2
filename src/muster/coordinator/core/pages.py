"""A zlib stream of independently compressed pages, each kept by what it holds: encoding a large
state again compresses only the pages that changed (as pigz joins its blocks).

Each page is raw deflate from a fresh compressor ended by a sync flush (byte-aligned, no reference
to what came before it), so the pages concatenate into one stream that any zlib reader reads
whole: `zlib.decompress`, an older leader's included. The stream's checksum is combined from the
pages' own (zlib's adler32_combine), so a kept page is never read again.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

LEVEL = 1
PAGE_ITEMS = 1024  # items per page on average: a page is ~80-250 KiB of JSON
_ZLIB_HEADER = bytes([0x78, 0x01])  # deflate, 32 KiB window, level 0-1 (a multiple of 31)
_FINAL_BLOCK = b"\x03\x00"  # an empty final fixed-Huffman block
_ADLER_MOD = 65521

Page = tuple[bytes, int, int]  # its deflate, the adler32 of its text, the text's length


def _deflate(text: bytes) -> Page:
    c = zlib.compressobj(LEVEL, zlib.DEFLATED, -15)
    return c.compress(text) + c.flush(zlib.Z_SYNC_FLUSH), zlib.adler32(text), len(text)


def _adler_combine(a1: int, a2: int, len2: int) -> int:
    """The adler32 of A + B from A's, B's and B's length (zlib's adler32_combine)."""
    s1 = ((a1 & 0xFFFF) + (a2 & 0xFFFF) - 1) % _ADLER_MOD
    s2 = ((a1 >> 16) + (a2 >> 16) + len2 * ((a1 & 0xFFFF) - 1)) % _ADLER_MOD
    return s1 | s2 << 16


def split(items: Sequence[str], ids: Iterable[str]) -> list[tuple[str, ...]]:
    """`items` cut into pages after each item whose id hashes to a page end: the cuts follow the
    ids, not the positions, so an item that leaves or changes changes its own page only."""
    pages, start = [], 0
    for i, node_id in enumerate(ids):
        if zlib.crc32(node_id.encode()) % PAGE_ITEMS == 0:  # not hash(): the same cuts in every process
            pages.append(tuple(items[start:i + 1]))
            start = i + 1
    if start < len(items):
        pages.append(tuple(items[start:]))
    return pages


class PageCache:
    """One job's pages from its last encoding (only those: it never holds more than one state's)."""

    def __init__(self) -> None:
        self._pages: dict[tuple[str, ...], Page] = {}
        self.compressed = 0  # pages its last call compressed (the others it had)

    def compress(self, parts: Sequence[str | list[tuple[str, ...]]]) -> bytes:
        """One zlib stream of `parts`: a str is compressed as it is; a list of pages (each a tuple
        of JSON items) is the items joined by commas, each page taken from the cache if it has it."""
        kept: dict[tuple[str, ...], Page] = {}
        self.compressed = 0
        out = [_ZLIB_HEADER]
        adler = 1
        for part in parts:
            if isinstance(part, str):
                pages = [_deflate(part.encode())] if part else []
            else:
                pages = [self._page(items, i > 0, kept) for i, items in enumerate(part)]
            for data, page_adler, length in pages:
                out.append(data)
                adler = _adler_combine(adler, page_adler, length)
        self._pages = kept
        out += [_FINAL_BLOCK, adler.to_bytes(4, "big")]
        return b"".join(out)

    def _page(self, items: tuple[str, ...], after: bool, kept: dict[tuple[str, ...], Page]) -> Page:
        key = (",",) + items if after else items  # a page after another starts with its comma
        page = kept.get(key) or self._pages.get(key)
        if page is None:
            page = _deflate((("," if after else "") + ",".join(items)).encode())
            self.compressed += 1
        kept[key] = page
        return page
