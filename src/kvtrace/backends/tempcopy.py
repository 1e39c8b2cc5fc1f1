"""Private copies a load makes of the files its programs map: a temp dir per load, named by the process that owns
it; bytes copied by the kernel; the dirs of processes that died before removing theirs, removed.

A loaded program keeps reading its file: a compiled library is mapped, an ExecuTorch program maps its constants
(shared, so a write to the file shows in them). A file the user replaces in place (``cp new.pte model.pte``
truncates and rewrites the same inode) would change those bytes under a running program, or cut them off
(SIGBUS). A copy only this load knows of keeps what was checked at load what runs.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO

__all__ = ["copy_range", "new_dir", "remove_stale_dirs"]


def new_dir(prefix: str) -> Path:
    """A fresh private temp dir ``<prefix><pid>-<random>`` (mode 0700) in the system temp dir."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def copy_range(src: BinaryIO, at: int, size: int, dest: Path, sync: bool = True) -> int:
    """``size`` bytes of the open file ``src`` from offset ``at`` into the new file ``dest`` (refused if it
    exists), by the kernel where it can (``copy_file_range``: no pass through this process's memory; a reflink
    on filesystems that share extents), else in 4 MiB chunks. ``sync``: written back to disk before returning,
    so that reclaim can drop its clean pages once they are mapped. Returns the bytes copied: fewer than ``size``
    when ``src`` ends early (the caller says what that means)."""
    kernel = hasattr(os, "copy_file_range")  # Linux
    done = 0
    with dest.open("xb") as out:
        while done < size:
            if kernel:
                try:
                    n = os.copy_file_range(src.fileno(), out.fileno(), size - done, at + done)
                except OSError:  # a filesystem pair that refuses it: the rest through user space, once
                    kernel = False
                    continue
            else:
                src.seek(at + done)
                n = out.write(src.read(min(size - done, 1 << 22)))
            if n == 0:
                break
            done += n
        out.flush()
        if sync:
            getattr(os, "fdatasync", os.fsync)(out.fileno())  # macOS has fsync only
    return done


def remove_stale_dirs(prefix: str) -> None:
    """Temp dirs of loads killed before they cleaned up (``<prefix><pid>-*``, that pid gone, ours)."""
    for d in Path(tempfile.gettempdir()).glob(f"{prefix}*-*"):
        m = re.fullmatch(rf"{re.escape(prefix)}(\d+)-.+", d.name)
        try:
            if m is None or not d.is_dir() or d.stat().st_uid != os.getuid() or int(m.group(1)) == os.getpid():
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (OSError, OverflowError):  # alive under another user, or vanished meanwhile
            continue
