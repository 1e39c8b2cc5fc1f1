"""Terminal output of the CLI: progress and status on stderr (rich), results on stdout; output paths
probed before minutes of work."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvtrace._errors import UsageError

__all__ = ["UI", "output_file", "tables_markdown"]


class UI:
    """stderr status/progress (rich) and stdout results; quiet/json switch them off."""

    def __init__(self, quiet: bool, json_mode: bool):
        from rich.console import Console

        self.quiet = quiet or json_mode
        self.json_mode = json_mode
        self.err = Console(stderr=True)
        self.out = Console()

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        t0 = time.perf_counter()
        if self.quiet:
            yield
            return
        with self.err.status(f"{what}..."):
            yield
        self.err.print(f"[dim]{what}: {time.perf_counter() - t0:.1f}s[/dim]")

    @contextlib.contextmanager
    def live(self, what: str) -> Iterator[Callable[[str], None]]:
        """A status line whose text the caller updates (``update(text)``); nothing in quiet mode."""
        if self.quiet:
            yield lambda text: None
            return
        with self.err.status(what) as status:
            yield lambda text: status.update(text)

    def info(self, text: str) -> None:
        if not self.quiet:
            self.err.print(text)

    def notice(self, text: str) -> None:
        """One line the user should see even in --quiet/--json mode (e.g. a cache entry rebuilt)."""
        self.err.print(f"kvtrace: {text}", markup=False, highlight=False, style="yellow", soft_wrap=True)


@contextlib.contextmanager
def output_file(path: str | None, flag: str) -> Iterator[Path | None]:
    """Check now, before minutes of capture, that ``path`` can be written: UsageError for a folder, a
    path inside a file, a folder without write permission or on a read-only mount. Missing folders are
    created for the probe and removed again if the command fails."""
    if path is None:
        yield None
        return
    p = Path(path).expanduser()
    folder = p.absolute().parent
    created = []
    try:
        if p.is_dir():
            raise UsageError(f"{flag} {path} is a directory; expected a file name such as model.kvt")
        missing = folder
        while not missing.exists():
            created.append(missing)
            missing = missing.parent
        if not missing.is_dir():
            raise UsageError(f"{flag} {path} cannot be written: {missing} is a file, not a folder; choose another path")
        for d in reversed(created):
            d.mkdir()
        fd, probe = tempfile.mkstemp(prefix=".kvtrace-probe-", dir=folder)  # permissions, mounts, quotas
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        remove_empty(created)
        raise UsageError(f"{flag} {path} cannot be written ({e.strerror or e}); expected a file in a writable "
                         "folder. Choose another path") from e
    except BaseException:
        remove_empty(created)
        raise
    try:
        yield p
    except BaseException:
        remove_empty(created)
        raise


def remove_empty(folders: list[Path]) -> None:
    for d in folders:  # deepest first
        with contextlib.suppress(OSError):
            d.rmdir()


def tables_markdown(renderable: Any) -> str:
    """A rich Table (or a Group of them) as Markdown text, every cell whole: for pipes and logs, where rich
    folds each column into 80 / n characters ("smoll│m2-13│5m-in..."). Title and caption become paragraphs;
    markup (``[green]PASS[/green]``) becomes its plain text."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def plain(cell: Any) -> str:
        text = cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain
        return " ".join(text.split()).replace("|", "/")

    if isinstance(renderable, Group):
        return "\n\n".join(tables_markdown(r) for r in renderable.renderables)
    if not isinstance(renderable, Table):
        return plain(renderable)
    cols = renderable.columns
    lines = [plain(renderable.title), ""] if renderable.title else []
    lines += ["| " + " | ".join(plain(c.header) for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(plain(cell) for cell in row) + " |"
              for row in zip(*(list(c.cells) for c in cols), strict=True)]
    if renderable.caption:
        lines += ["", plain(renderable.caption)]
    return "\n".join(lines)
