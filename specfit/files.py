"""Output files that survive a crash: nothing completed is lost, nothing half-written is read.

Whole files (calibration, trace sequences, a trace's meta.json, report.md) are written to a
temporary file in the same directory, flushed to disk and renamed over the destination
(:func:`write_atomic`): a reader sees the old file or the new one, never a part.

JSON-lines results are appended instead (:func:`append_jsonl_lines`), one ``write`` per batch of
whole lines and an ``fsync`` after it, so each row is on disk as soon as its run completes and
concurrent jobs of a sweep may share one file. A kill during that write can leave at most the last
line cut short; :func:`read_jsonl` ignores such a torn last line and the next append cuts it off
(only a line without its newline that starts like a row is torn: every complete row is kept, and
a file that is not JSON lines is refused, never cut).

:func:`check_writable` (and :func:`check_results_file` for results) is called before any decoding
starts, so a mistyped destination costs nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Sequence

from specfit.errors import ConfigError, ModelError, SpecfitError


def check_writable(path: str | Path, key: str, directory: bool = False, label: str | None = None) -> Path:
    """``path`` as a Path, or a :class:`ConfigError` naming ``key`` if nothing can be written there.

    Nothing is created: the nearest existing folder on the way is probed with a temporary file.
    Messages start ``key=path:`` (or ``label:`` when given).
    """
    path = Path(path).expanduser()
    where = label or f"{key}={path}"
    if path.exists():
        if directory and not path.is_dir():
            raise ConfigError(f"{where}: exists and is not a directory")
        if not directory and path.is_dir():
            raise ConfigError(f"{where}: is a directory, not a file")
    probe = path if directory else path.parent
    while not probe.exists():
        if probe.is_symlink():  # a dangling link: writing through it would fail
            raise ConfigError(f"{where}: {probe} is a broken symbolic link")
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{where}: {probe} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=probe, prefix=".specfit-write-check-"):
            pass
        if path.is_file():
            with path.open("ab"):
                pass
    except OSError as exc:
        raise ConfigError(f"{where}: cannot write there ({exc.strerror or exc})") from exc
    return path


def missing_directory(path: str | Path) -> str:
    """Why ``path``, which is not a directory, cannot be one, for a one-line error: a file is named
    as a file, not as a missing directory."""
    return "is a file, not a directory" if Path(path).expanduser().exists() else "no such directory"


def check_results_file(path: str | Path, key: str = "results_file") -> Path:
    """:func:`check_writable`, and an existing file must be JSON lines that specfit may append to.

    Appending cuts off a torn last line, so a file that is not JSON lines (a mistyped
    ``results_file=`` naming someone's notes) is refused before anything runs, never truncated."""
    path = check_writable(path, key)
    if path.is_file() and path.stat().st_size:
        for n, row in enumerate(read_jsonl(path, key), 1):
            if not is_results_row(row):  # e.g. a JSON-lines workload ({"prompt": ...} per line)
                raise ConfigError(f"{key}={path}: row {n} is not a specfit results row (no "
                                  f"{' or '.join(map(repr, RESULTS_ROW_KEYS))} key); specfit appends only to "
                                  f"its own results files: name a new file or a results.jsonl")
    return path


#: Every row specfit writes to a results file has ``command`` (the command that wrote it); decoding
#: runs have ``output_throughput`` too (the only mark of rows written before ``command`` was added).
RESULTS_ROW_KEYS = ("command", "output_throughput")


def is_results_row(row: dict[str, Any]) -> bool:
    """Whether a JSON-lines row looks like one specfit wrote to a results file."""
    return any(k in row for k in RESULTS_ROW_KEYS)


def _current_umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it: put it back at once
    os.umask(mask)
    return mask


_UMASK = _current_umask()  # read once: setting it to read it is not thread-safe


def write_atomic(path: str | Path, data: str | bytes | Callable[[IO[bytes]], None]) -> Path:
    """Write ``data`` (text, bytes, or a function that writes to a binary file) to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file private (0600); the result gets the mode a plain open() would give
        # it (the umask's), or keeps the one it had
        if hasattr(os, "fchmod"):
            os.fchmod(fd, path.stat().st_mode & 0o777 if path.is_file() else 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_stale_temporaries(folder: Path) -> None:
    """Delete temporary files an interrupted :func:`write_atomic` left in ``folder``."""
    for tmp in folder.glob(".*.tmp"):
        if tmp.is_file() and not tmp.name.startswith(".specfit-write-check-"):
            tmp.unlink(missing_ok=True)


def append_jsonl_lines(path: str | Path, rows: Iterable[dict[str, Any]], default: Callable[[Any], Any] = str) -> Path:
    """Append ``rows`` as JSON lines and fsync, cutting off a torn last line a crash left first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(row, default=default) + "\n" for row in rows).encode("utf-8")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o666)
        try:
            _cut_torn_tail(fd, path)
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:  # a full disk, a device that refuses writes: say which file lost its rows
        raise ConfigError(f"{path}: cannot append the results to it ({exc.strerror or exc}); the run's rows "
                          "were not saved") from exc
    return path


def _cut_torn_tail(fd: int, path: Path) -> None:
    size = os.fstat(fd).st_size
    if not size or os.pread(fd, 1, size - 1) == b"\n":
        return
    start = max(0, size - (1 << 20))
    tail = os.pread(fd, size - start, start)
    keep = start + tail.rfind(b"\n") + 1 if b"\n" in tail else start
    last = tail[keep - start:]
    if _parses(last):  # a complete row whose newline is missing (written by hand): keep it
        os.write(fd, b"\n")
        return
    if not _torn_row(last):
        raise ConfigError(f"{path}: its last line is not JSON; not a specfit results file, so nothing was appended")
    os.ftruncate(fd, keep)
    print(f"specfit: {path}: dropped an incomplete last line (a write was interrupted)", file=sys.stderr)


def _torn_row(line: bytes) -> bool:
    """Whether ``line`` can be the start of a row cut short (every row is a JSON object)."""
    return line.lstrip().startswith(b"{")


def _parses(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line.decode("utf-8")), dict)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False


def read_jsonl(path: str | Path, key: str = "results_file") -> list[dict[str, Any]]:
    """The rows of a JSON-lines file; a torn last line (no newline, not JSON) is ignored.

    Anything else that is not a JSON object is a :class:`ConfigError` naming the file and line.
    """
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{key}={path}: not UTF-8 text (byte {exc.start}); not a specfit results file") from exc
    except OSError as exc:
        raise ConfigError(f"{key}={path}: cannot read it ({exc.strerror or exc})") from exc
    lines = text.split("\n")
    torn = lines.pop()  # "" when the file ends with a newline
    rows = []
    try:
        for n, line in enumerate(lines, 1):
            if line.strip():
                rows.append(_row(line, path, n, key))
    except ConfigError:
        if len(lines) > 1 and _parses(text.encode("utf-8")):  # an indented JSON document, e.g. learned.json
            raise ConfigError(f"{key}={path}: one JSON document, not JSON lines (one object per line, as specfit's "
                              "results.jsonl files are); not a specfit results file") from None
        raise
    if torn.strip():
        if _parses(torn.encode("utf-8")):
            rows.append(json.loads(torn))
        elif not _torn_row(torn.encode("utf-8")):
            raise ConfigError(f"{key}={path}: line {len(lines) + 1} is not JSON; not a specfit results file")
    return rows


def _row(line: str, path: Path, n: int, key: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{key}={path}: line {n} is not JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise ConfigError(f"{key}={path}: line {n} is not a JSON object")
    return row


def read_json_object(path: Path, where: str, error: type[SpecfitError] = ConfigError, what: str = "") -> dict[str, Any]:
    """The JSON object in ``path``, or one line ``where: <problem>[; what]`` as ``error``.

    Shared by every reader of a user's JSON file (checkpoint and head configs, safetensors indexes,
    calibrations), so bad bytes, bad JSON and a non-object are reported the same way everywhere."""
    suffix = f"; {what}" if what else ""
    try:
        raw = json.loads(Path(path).read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not UTF-8 text (byte {exc.start}){suffix}") from exc
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON ({exc.msg}, line {exc.lineno}){suffix}") from exc
    except OSError as exc:
        raise error(f"{where}: cannot read it ({exc.strerror or exc})") from exc
    if not isinstance(raw, dict):
        raise error(f"{where}: holds a JSON {type(raw).__name__}, not an object{suffix}")
    return raw


def head_weights_digest(directory: str | None, skip: Sequence[str] = ()) -> str | None:
    """A short digest of a head directory's weight files (but the names in ``skip``), or None (no
    directory, no weights).

    Each file's size and its first and last MiB, so a head of gigabytes is not read whole on every
    build; a retrained head of the same shape differs in both. Cached per (path, size, mtime)."""
    if not directory:
        return None
    folder = Path(directory).expanduser()
    try:
        files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt") and p.name not in skip)
        stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    except OSError:
        return None
    return _digest(str(folder.resolve()), stamp) if files else None


@functools.lru_cache(maxsize=32)
def _digest(folder: str, stamp: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha1()
    for name, size, _ in stamp:
        h.update(f"{name}:{size}".encode())
        with open(Path(folder) / name, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 1 << 20:  # the last MiB, or what the first left (a file of 1-2 MiB is read whole)
                fh.seek(max(1 << 20, size - (1 << 20)))
                h.update(fh.read())
    return h.hexdigest()[:12]


def check_safetensors(file: Path, what: str = "") -> None:
    """The header parses and the file is as long as the header says (else: truncated or not safetensors)."""
    prefix = f"{what}: " if what else ""
    size = file.stat().st_size
    with file.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelError(f"{prefix}{file.name} is not a safetensors file ({size} bytes, no header)")
        header_len = int.from_bytes(head, "little")
        if header_len > size - 8:
            raise ModelError(f"{prefix}{file.name} is truncated or not a safetensors file "
                             f"({size} bytes, its header alone claims {header_len})")
        try:
            header = json.loads(fh.read(header_len))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise ModelError(f"{prefix}{file.name} is not a safetensors file (unreadable header)") from exc
    if 8 + header_len + end > size:
        raise ModelError(f"{prefix}{file.name} is truncated: {size} bytes, its header needs {8 + header_len + end}")
