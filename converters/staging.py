"""Where fvconvert writes: a temporary directory beside OUT, published onto OUT only when complete.

- Names: `.<OUT name>.fvconvert-<kind>-<pid>-<random>` (kind: tmp, check, old, journal). A run first removes the
  ones whose pid is no longer alive (left by a SIGKILL or a crash) and finishes or undoes any replacement they
  left half done, so nothing is left behind forever.
- SIGTERM / SIGINT while staging raise `Interrupted`: the temporary directory is removed and fvconvert exits 143
  / 130 with one line.
- `--force` replaces OUT atomically: renameat2(RENAME_EXCHANGE) on Linux swaps the two directories in one step;
  elsewhere a journal records the two renames, and a crash between them is undone by the next run (the old OUT
  comes back).
- Permissions follow the umask (directories 0777 & ~umask, files 0666 & ~umask), as any other tool's output.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from converters.errors import ConversionError

_NAME = re.compile(r"^\.(?P<out>.+)\.fvconvert-(?P<kind>tmp|check|old|journal)-(?P<pid>\d+)-[0-9a-f]+$")
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(BaseException):
    """SIGTERM / SIGINT arrived while fvconvert was writing; the partial output has been removed."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = EXIT_SIGNAL.get(signum, 128 + signum)


def staging_name(out: Path, kind: str) -> Path:
    parent = out.parent if str(out.parent) else Path(".")
    return parent / f".{out.name}.fvconvert-{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_dir(path: Path) -> Path:
    """mkdir with the umask's permissions (tempfile.mkdtemp would force 0700)."""
    os.mkdir(path)
    os.chmod(path, 0o777 & ~_umask())
    return path


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_stale(out: Path) -> list[str]:
    """Undo or finish what dead fvconvert runs left beside OUT; returns what was done (one line each)."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        return []
    done = []
    entries = [(p, _NAME.match(p.name)) for p in parent.iterdir()]
    stale = [(p, m) for p, m in entries if m and m["out"] == out.name and not _pid_alive(int(m["pid"]))]
    for p, m in sorted(stale, key=lambda e: e[1]["kind"] != "journal"):  # journals first: they may restore OUT
        if m["kind"] == "journal":
            try:
                j = json.loads(p.read_text())
            except (OSError, ValueError):
                j = {}
            old = Path(j.get("old", ""))
            if j and not os.path.lexists(out) and old.exists():
                os.replace(old, out)  # the crash came between the renames: the old OUT comes back
                done.append(f"restored {out} from an interrupted --force replacement")
            p.unlink(missing_ok=True)
        elif p.exists():
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
            done.append(f"removed stale {p.name} (pid {m['pid']} is gone)")
    return done


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL / ENOSYS / EOPNOTSUPP: this filesystem cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_atomically(tmp: Path, out: Path) -> None:
    """Put tmp at OUT, replacing an existing OUT so that a crash at any point leaves the old or the new OUT (the
    journal fallback: the next run restores the old one)."""
    if not os.path.lexists(out):
        os.replace(tmp, out)
        return
    if exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)   # tmp now holds the old OUT
        return
    aside = staging_name(out, "old")
    journal = staging_name(out, "journal")
    journal.write_text(json.dumps({"out": str(out), "old": str(aside), "new": str(tmp)}))
    os.replace(out, aside)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(aside, out)
        raise
    finally:
        journal.unlink(missing_ok=True)
    shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def signals_interrupt():
    """While the block runs (main thread only), SIGTERM and SIGINT raise Interrupted so `finally` blocks clean up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in EXIT_SIGNAL}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def staged_output(out: Path):
    """A temporary directory beside OUT; put onto OUT (replacing it atomically) when the block succeeds, removed
    (with any parent folders it had to create) when it fails or a signal arrives: nothing is left behind."""
    parent = out.parent if str(out.parent) else Path(".")
    missing_parents = []
    p = parent
    while not p.exists():
        missing_parents.append(p)
        p = p.parent
    created: list[Path] = []
    tmp: Path | None = None
    published = False
    with signals_interrupt():
        try:
            try:
                parent.mkdir(parents=True, exist_ok=True)
                created = list(reversed(missing_parents))
                recover_stale(out)
                tmp = make_dir(staging_name(out, "tmp"))
            except OSError as e:
                raise ConversionError(f"{out}: cannot create the output directory ({e.strerror or e})") from None
            try:
                yield tmp
            except OSError as e:
                raise ConversionError(f"{getattr(e, 'filename', None) or out}: {e.strerror or e}") from None
            try:
                replace_atomically(tmp, out)
            except OSError as e:
                raise ConversionError(f"{getattr(e, 'filename', None) or out}: {e.strerror or e}") from None
            published = True
        finally:
            if not published:
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                for d in reversed(created):
                    try:
                        d.rmdir()
                    except OSError:
                        pass


def _is_within(a: Path, b: Path) -> bool:
    try:
        a.resolve().relative_to(b.resolve())
        return True
    except (ValueError, RuntimeError, OSError):
        return False


def check_output(src: Path, out: Path, force: bool, files: tuple[Path, ...] | list[Path] = ()) -> None:
    """OUT may be replaced only with force, and never when it is, holds, or lies inside the source or one of the
    source's files (`files`: every file the conversion reads). Checked before anything is touched, after putting
    back an OUT that a killed `--force` run had moved aside."""
    try:
        recover_stale(out)
    except OSError as e:
        raise ConversionError(f"{out}: cannot clean up after an earlier interrupted run ({e.strerror or e})") from None
    if os.path.lexists(out):
        if not force:
            raise ConversionError(f"{out}: output already exists; refusing to overwrite (pass --force / force=True)")
        for p in [src, *files]:
            if not os.path.lexists(p):
                continue
            if _is_within(p, out):
                raise ConversionError(f"{out}: output is (or contains) the source file {p}; refusing to replace it")
            if Path(p).is_dir() and _is_within(out, p):
                raise ConversionError(f"{out}: output lies inside the source {p}; refusing to replace it")
    if src.exists() and src.is_dir() and out.resolve() == src.resolve():
        raise ConversionError(f"{out}: output and source are the same directory")


__all__ = ["Interrupted", "check_output", "exchange", "make_dir", "recover_stale", "replace_atomically",
           "signals_interrupt", "staged_output", "staging_name"]
