"""Reading the user's JSON files and writing soap's outputs, with every failure a one-line SoapError.

- `read_json(path, what=..., fix=...)`: the parsed document; a missing or unreadable file, a name too
  long for the file system, bytes that are not UTF-8, invalid JSON, or nesting deeper than Python's
  parser recurses (`RecursionError`) each become `SoapError("<what> <path> ...; <fix>")`.
- `check_writable(path, what=...)`: run before the work that produces an output, so a path that can
  never be written (a directory, a parent that is a file, no permission, a name too long) fails in a
  second rather than after a search, a simulation or a training run.
- `write_atomic(path, data, what=...)`: a temporary file in the target's folder, fsync, `os.replace`;
  a missing folder is created (as `soap plan -o` always did), and the file keeps the replaced file's
  permissions (a new one gets the umask's). A crash or an error leaves the previous file whole and no
  temporary file behind.

It lives in the lowest package (next to `tracer.errors`) so every subsystem can use it.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from tracer.errors import SoapError


def read_json(path: str | os.PathLike[str], *, what: str, fix: str) -> Any:
    """The JSON document at `path`; every way it can fail is a SoapError naming `what` and `fix`."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise SoapError(f"{what} {p} does not exist; {fix}") from None
    except OSError as exc:
        raise SoapError(f"cannot read {what} {p} ({_reason(exc)}); {fix}") from None
    except UnicodeDecodeError as exc:
        raise SoapError(f"{what} {p} is not UTF-8 text (byte {exc.start}); {fix}") from None
    except ValueError:  # an embedded NUL byte
        raise SoapError(f"cannot read {what} {str(p)!r}: the path holds a NUL byte; {fix}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SoapError(f"{what} {p} is not valid JSON (line {exc.lineno}: {exc.msg}); {fix}") from None
    except RecursionError:
        raise SoapError(f"{what} {p} is nested too deeply to parse; {fix}") from None


def check_writable(path: str | os.PathLike[str], *, what: str) -> None:
    """Raise a SoapError now if `write_atomic(path, ...)` cannot succeed later."""
    target = Path(path)
    if _is_dir(target, what):
        raise SoapError(f"{what} {target} is a directory; give a file path")
    _check_creatable(target, target.parent, what)


def check_writable_dir(path: str | os.PathLike[str], *, what: str) -> None:
    """Raise a SoapError now if the directory `path` cannot be created or written in later."""
    target = Path(path)
    if _exists(target, what) and not _is_dir(target, what):
        raise SoapError(f"cannot use {what} {target}: it is not a directory; pick another path")
    _check_creatable(target, target, what)


def _check_creatable(target: Path, folder: Path, what: str) -> None:
    """`folder` (or, missing, the nearest existing ancestor, where the missing folders get created) must be
    a directory this process can write in."""
    while not _exists(folder, what):
        folder = folder.parent
    if not _is_dir(folder, what):
        raise SoapError(f"cannot write {what} {target}: {folder} is not a directory; pick another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SoapError(f"cannot write {what} {target}: no permission to write in {folder}; pick another path")


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, what: str) -> Path:
    """Write `data` to `path` so that a crash leaves the old file or the new one, never half of one."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name[:64]}.", suffix=".tmp")
    except (OSError, ValueError) as exc:
        raise _unwritable(what, target, exc) from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), permissions_for_new_file(target))
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _unwritable(what, target, exc) from None
        raise
    return target


def permissions_for_new_file(target: Path) -> int:
    """The permissions the file gets: the replaced file's, else what `open()` would give (0o666 less the
    umask) rather than the 0o600 of a temporary file."""
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _unwritable(what: str, path: Path, exc: OSError | ValueError) -> SoapError:
    if isinstance(exc, ValueError):  # an embedded NUL byte
        return SoapError(f"cannot write {what} {str(path)!r}: the path holds a NUL byte; pick another path")
    return SoapError(f"cannot write {what} {path} ({_reason(exc)}); pick another path")


def _stat_mode(path: Path, what: str) -> int | None:
    try:
        return path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as exc:  # a name too long, a loop of links, a NUL byte
        raise _unwritable(what, path, exc) from None


def _exists(path: Path, what: str) -> bool:
    return _stat_mode(path, what) is not None


def _is_dir(path: Path, what: str) -> bool:
    mode = _stat_mode(path, what)
    return mode is not None and stat.S_ISDIR(mode)
