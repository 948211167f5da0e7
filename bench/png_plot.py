"""A dependency-free line chart written as PNG (zlib + a 3x5 pixel font for labels).

Enough for "latency against load" plots from the serving benchmark without matplotlib.
"""
from __future__ import annotations

import struct
import zlib

# 3x5 glyphs, rows separated by '/': '#' on, '.' off.
_FONT = {
    "0": "###/#.#/#.#/#.#/###", "1": ".#./##./.#./.#./###", "2": "###/..#/###/#../###", "3": "###/..#/###/..#/###",
    "4": "#.#/#.#/###/..#/..#", "5": "###/#../###/..#/###", "6": "###/#../###/#.#/###", "7": "###/..#/..#/..#/..#",
    "8": "###/#.#/###/#.#/###", "9": "###/#.#/###/..#/###", ".": ".../.../.../.../.#.", "-": ".../.../###/.../...",
    "/": "..#/..#/.#./#../#..", " ": ".../.../.../.../...", "(": ".#./#../#../#../.#.", ")": ".#./..#/..#/..#/.#.",
    ":": ".../.#./.../.#./...", "_": ".../.../.../.../###", "%": "#.#/..#/.#./#../#.#", "A": ".#./#.#/###/#.#/#.#",
    "B": "##./#.#/##./#.#/##.", "C": "###/#../#../#../###", "D": "##./#.#/#.#/#.#/##.", "E": "###/#../###/#../###",
    "F": "###/#../###/#../#..", "G": "###/#../#.#/#.#/###", "H": "#.#/#.#/###/#.#/#.#", "I": "###/.#./.#./.#./###",
    "J": "..#/..#/..#/#.#/###", "K": "#.#/#.#/##./#.#/#.#", "L": "#../#../#../#../###", "M": "#.#/###/###/#.#/#.#",
    "N": "##./#.#/#.#/#.#/#.#", "O": "###/#.#/#.#/#.#/###", "P": "###/#.#/###/#../#..", "Q": "###/#.#/#.#/###/..#",
    "R": "##./#.#/##./#.#/#.#", "S": "###/#../###/..#/###", "T": "###/.#./.#./.#./.#.", "U": "#.#/#.#/#.#/#.#/###",
    "V": "#.#/#.#/#.#/#.#/.#.", "W": "#.#/#.#/###/###/#.#", "X": "#.#/#.#/.#./#.#/#.#", "Y": "#.#/#.#/.#./.#./.#.",
    "Z": "###/..#/.#./#../###",
}
COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189)]


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.w, self.h = width, height
        self.px = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, c: tuple[int, int, int], r: int = 0) -> None:
        for yy in range(y - r, y + r + 1):
            for xx in range(x - r, x + r + 1):
                if 0 <= xx < self.w and 0 <= yy < self.h:
                    i = (yy * self.w + xx) * 3
                    self.px[i:i + 3] = bytes(c)

    def line(self, x0: int, y0: int, x1: int, y1: int, c, r: int = 0) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for s in range(steps + 1):
            self.dot(round(x0 + (x1 - x0) * s / steps), round(y0 + (y1 - y0) * s / steps), c, r)

    def text(self, x: int, y: int, s: str, c=(0, 0, 0), scale: int = 2) -> None:
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT[" "])
            for i, bit in enumerate(glyph.replace("/", "")):
                if bit == "#":
                    for dy in range(scale):
                        for dx in range(scale):
                            self.dot(x + (i % 3) * scale + dx, y + (i // 3) * scale + dy, c)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3])
                       for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + \
                struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def line_chart(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str,
               ylabel: str, width: int = 720, height: int = 440) -> bytes:
    """`series`: name -> [(x, y)]; one colored line each, legend top left, linear axes from 0."""
    cv = Canvas(width, height)
    left, right, top, bottom = 70, width - 20, 40, height - 50
    pts = [p for s in series.values() for p in s]
    xmax = max((p[0] for p in pts), default=1.0) * 1.05 or 1.0
    ymax = max((p[1] for p in pts), default=1.0) * 1.1 or 1.0

    def to_px(x: float, y: float) -> tuple[int, int]:
        return (round(left + (right - left) * x / xmax), round(bottom - (bottom - top) * y / ymax))

    cv.text(left, 10, title)
    grey = (200, 200, 200)
    for i in range(6):
        gx = left + (right - left) * i // 5
        gy = bottom - (bottom - top) * i // 5
        cv.line(gx, top, gx, bottom, grey)
        cv.line(left, gy, right, gy, grey)
        cv.text(gx - 10, bottom + 8, _fmt(xmax * i / 5))
        cv.text(4, gy - 5, _fmt(ymax * i / 5))
    cv.line(left, bottom, right, bottom, (0, 0, 0))
    cv.line(left, top, left, bottom, (0, 0, 0))
    cv.text((left + right) // 2 - 4 * len(xlabel), height - 20, xlabel)
    cv.text(left + 8, top + 4, ylabel)
    for k, (name, s) in enumerate(series.items()):
        c = COLORS[k % len(COLORS)]
        # in run order (increasing offered load), not sorted by achieved req/s
        for (x0, y0), (x1, y1) in zip(s, s[1:]):
            cv.line(*to_px(x0, y0), *to_px(x1, y1), c, r=1)
        for x, y in s:
            cv.dot(*to_px(x, y), c, r=3)
        cv.line(left + 12, top + 30 + 16 * k, left + 32, top + 30 + 16 * k, c, r=1)
        cv.text(left + 40, top + 25 + 16 * k, name, c)
    return cv.png()
