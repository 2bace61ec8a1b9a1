"""The prose corpora (Shakespeare, King James Bible) and their fixed train / held-out split.

The split is at document level (whole plays, whole books), so held-out perplexity measures
generalisation to unseen text rather than memorisation of neighbouring lines.

Text normalisation choices (kept deliberately simple and documented here):

* Shakespeare: Project Gutenberg header/footer boilerplate is removed when present (the
  ``*** START OF`` / ``*** END OF`` markers and the licence blocks around them), line ends are
  normalised, trailing spaces stripped and runs of blank lines collapsed to one blank line.
* KJV: the ``chapter:verse`` prefixes are dropped so the model learns prose, not verse numbers.
  Some source lines hold several verses run together (``1:2 ... 1:3 ...``); every verse goes on
  its own line. Chapters are separated by a blank line, and the document starts with the book's
  title (``The Book of Ruth``). Stray lines without a verse number (a heading left in the source)
  are dropped.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from specfit.data.paths import resolve_data_dir

#: Held-out Shakespeare plays (file stem without ``_gut``): four shorter plays of different kinds.
HELDOUT_PLAYS: tuple[str, ...] = ("macbeth", "twelfth_night", "julius_caesar", "tempest")

#: Held-out KJV books (1-based book numbers): narrative, wisdom, prophecy, gospel and epistle.
HELDOUT_KJV_BOOKS: tuple[int, ...] = (8, 17, 21, 32, 41, 50)

#: The 66 books in the order of ``corpus/kjv/bookNN.txt``.
KJV_BOOK_NAMES: tuple[str, ...] = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos", "Obadiah",
    "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah", "Malachi",
    "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians", "2 Corinthians",
    "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians", "2 Thessalonians",
    "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James", "1 Peter", "2 Peter",
    "1 John", "2 John", "3 John", "Jude", "Revelation",
)

#: Held-out document names as they appear in :class:`CorpusSplit` (``shakespeare/<play>``,
#: ``kjv/<NN>-<book>``).
HELDOUT_DOCUMENTS: tuple[str, ...] = tuple(
    [f"shakespeare/{p}" for p in HELDOUT_PLAYS]
    + [f"kjv/{n:02d}-{KJV_BOOK_NAMES[n - 1].lower().replace(' ', '_')}" for n in HELDOUT_KJV_BOOKS]
)

_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_GUTENBERG_END = re.compile(
    r"^(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
    re.I | re.M,
)
_VERSE = re.compile(r"(?:(?<=\s)|^)(\d+):(\d+)\s+")


@dataclass
class CorpusSplit:
    """Documents as ``(name, text)`` pairs, split into training and held-out sets."""

    train: list[tuple[str, str]] = field(default_factory=list)
    heldout: list[tuple[str, str]] = field(default_factory=list)

    def chars(self) -> tuple[int, int]:
        """Total characters in (train, heldout)."""
        return sum(len(t) for _, t in self.train), sum(len(t) for _, t in self.heldout)


def _normalise_lines(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\ufeff", "")
    lines = [line.rstrip() for line in text.split("\n")]
    out = re.sub(r"\n{3,}", "\n\n", "\n".join(lines))
    return out.strip("\n") + "\n"


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg boilerplate: everything before START and after END markers.

    Texts without markers (already stripped transcriptions) pass through unchanged apart from
    whitespace normalisation.
    """
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return _normalise_lines(text)


def clean_kjv(text: str, title: str | None = None) -> str:
    """KJV book text without ``chapter:verse`` prefixes: one verse a line, chapters split by a blank line."""
    verses: list[tuple[int, str]] = []
    for raw in text.replace("\r\n", "\n").split("\n"):
        line = raw.strip()
        if not line:
            continue
        matches = list(_VERSE.finditer(line))
        if not matches or matches[0].start() != 0:
            # a stray heading in the source (e.g. a bare book name): not verse text
            continue
        for i, m in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
            verse = line[m.end():end].strip()
            if verse:
                verses.append((int(m.group(1)), verse))
    parts: list[str] = [f"The Book of {title}\n\n"] if title else []
    chapter = None
    for ch, verse in verses:
        if chapter is not None and ch != chapter:
            parts.append("\n")
        chapter = ch
        parts.append(verse + "\n")
    return "".join(parts)


def load_shakespeare(data_dir: str | os.PathLike[str] | None = None) -> list[tuple[str, str]]:
    """All Shakespeare documents, cleaned, sorted by name (``shakespeare/<play>``)."""
    root = resolve_data_dir(data_dir, "corpus/shakespeare") / "corpus" / "shakespeare"
    docs = []
    for path in sorted(root.glob("*.txt")):
        name = path.stem.removesuffix("_gut")
        docs.append((f"shakespeare/{name}", strip_gutenberg(path.read_text(encoding="utf-8", errors="replace"))))
    if not docs:
        raise FileNotFoundError(f"no .txt files in {root}")
    return docs


def load_kjv(data_dir: str | os.PathLike[str] | None = None) -> list[tuple[str, str]]:
    """All KJV books, cleaned, in canonical order (``kjv/<NN>-<book>``)."""
    root = resolve_data_dir(data_dir, "corpus/kjv") / "corpus" / "kjv"
    docs = []
    for path in sorted(root.glob("book*.txt")):
        num = int(path.stem.removeprefix("book"))
        title = KJV_BOOK_NAMES[num - 1] if 1 <= num <= len(KJV_BOOK_NAMES) else f"Book {num}"
        name = f"kjv/{num:02d}-{title.lower().replace(' ', '_')}"
        docs.append((name, clean_kjv(path.read_text(encoding="utf-8", errors="replace"), title)))
    if not docs:
        raise FileNotFoundError(f"no bookNN.txt files in {root}")
    return docs


def load_corpus(data_dir: str | os.PathLike[str] | None = None) -> CorpusSplit:
    """Shakespeare + KJV, split deterministically by :data:`HELDOUT_DOCUMENTS`.

    Raises :class:`~specfit.data.paths.DataDirError` naming the path when the data is absent.
    """
    split = CorpusSplit()
    held = set(HELDOUT_DOCUMENTS)
    docs = load_shakespeare(data_dir) + load_kjv(data_dir)
    for name, text in docs:
        (split.heldout if name in held else split.train).append((name, text))
    missing = held - {n for n, _ in split.heldout}
    if missing:
        raise FileNotFoundError(f"held-out documents missing from the data: {sorted(missing)}")
    return split
