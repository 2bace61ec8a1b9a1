"""Where the training and evaluation data live (../shared/data beside the repository by default)."""

from __future__ import annotations

import os
from pathlib import Path

#: The repository root (``specfit/data/paths.py`` -> two levels up). Used only to find the
#: default data directory ``<repo>/../shared/data``; an installed wheel has no such sibling and
#: gets a clear error instead.
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Environment variable that overrides the default data directory.
DATA_DIR_ENV = "SPECFIT_DATA_DIR"


class DataDirError(FileNotFoundError):
    """The training data directory (or a required part of it) is missing."""


def default_data_dir() -> Path:
    """Where the training data lives unless told otherwise.

    ``$SPECFIT_DATA_DIR`` if set, else ``<repo>/../shared/data`` resolved from the repository
    root (not from the current directory, so commands work from anywhere in the checkout).
    """
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return (REPO_ROOT / ".." / "shared" / "data").resolve()


def resolve_data_dir(data_dir: str | os.PathLike[str] | None, *required: str) -> Path:
    """Return ``data_dir`` (or the default) as a Path, checking that it and ``required`` exist.

    Raises :class:`DataDirError` naming the missing path and how to point at the data, because a
    user's machine usually has no ``../shared/data``.
    """
    path = Path(data_dir).expanduser().resolve() if data_dir is not None else default_data_dir()
    if path.exists() and not path.is_dir():
        raise DataDirError(f"data directory {path} is a file, not a directory (workloads take workload.data_dir=DIR, "
                           f"the trainers data_dir=DIR; or set ${DATA_DIR_ENV}; it holds corpus/ and gsm/)")
    if not path.is_dir():
        raise DataDirError(
            f"data directory not found: {path} (workloads take workload.data_dir=..., the trainers data_dir=...; "
            f"or set ${DATA_DIR_ENV}; the project expects ../shared/data "
            "beside the repository, holding corpus/ and gsm/)"
        )
    for rel in required:
        sub = path / rel
        if not sub.exists():
            raise DataDirError(f"training data incomplete: {sub} is missing (data directory {path})")
    return path
