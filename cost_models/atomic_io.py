"""Files written whole or not at all.

A crash, a full disk or a SIGKILL while a plan, an export, a calibration or a checkpoint manifest is
being written must never leave a truncated file that a later command reads as if it were complete. Every
output therefore goes to a temporary file in the destination's own directory (so the final ``rename`` is
atomic on POSIX file systems), is flushed and fsynced, and only then replaces the destination; the
directory is fsynced too so the rename itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from .errors import CostModelError


def _check_parent(path: Path, error: type[Exception]) -> None:
    parent = path.parent
    if not parent.exists():
        raise error(f"cannot write {path}: the directory {parent} does not exist (create it first or "
                    f"choose another path)")
    if not parent.is_dir():
        raise error(f"cannot write {path}: {parent} is not a directory")
    if path.is_dir():
        raise error(f"cannot write {path}: it is a directory; give a file name")


def _through_links(path: Path, error: type[Exception]) -> Path:
    """The file a symbolic link at ``path`` points to (followed to its end), so the output is written through
    the link, as ``>`` in a shell does, instead of replacing the link with a regular file. A loop is refused."""
    if not path.is_symlink():
        return path
    target = Path(os.path.realpath(path))
    if target.is_symlink():  # realpath stops at a loop and returns a link
        raise error(f"cannot write {path}: it is a symbolic link that loops; remove it or give another path")
    return target


def fsync_directory(directory: str | Path) -> None:
    """Make a rename or a new entry in ``directory`` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(str(directory), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_output(path: str | Path, mode: str = "w", *,
                  error: type[Exception] = CostModelError) -> Iterator[IO]:
    """An open file whose content replaces ``path`` only if the ``with`` block finishes without an error.

    ``mode`` is ``"w"`` (text) or ``"wb"`` (bytes). On any exception the temporary file is removed and the
    previous ``path`` (if any) is left untouched. Errors about the destination (missing directory, no
    permission) are raised as ``error`` with the path named.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_output mode must be 'w' or 'wb', not {mode!r}")
    path = _through_links(Path(path).expanduser(), error)
    _check_parent(path, error)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    except OSError as exc:
        raise error(f"cannot write {path}: {exc.strerror or exc}") from exc
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        if path.exists():
            # Keep the destination's permission bits (mkstemp creates 0600).
            with contextlib.suppress(OSError):
                os.chmod(tmp, path.stat().st_mode & 0o7777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_directory(path.parent)


def atomic_write_text(path: str | Path, text: str, *, error: type[Exception] = CostModelError) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_output`)."""
    try:
        with atomic_output(path, "w", error=error) as handle:
            handle.write(text)
    except OSError as exc:
        raise error(f"cannot write {path}: {exc.strerror or exc}") from exc


def write_output(path: str | Path, text: str, *, error: type[Exception] = CostModelError) -> None:
    """``text`` to ``path`` atomically, or to standard output when ``path`` is ``-``."""
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    atomic_write_text(path, text, error=error)
