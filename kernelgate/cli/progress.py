"""A progress bar on stderr for long commands (rich) on a terminal; silent when asked, when
stderr is a file or pipe (a log gets no bar frames), or without rich."""
from __future__ import annotations

import sys


class Progress:
    def __init__(self, label: str, total: int, quiet: bool = False):
        self.label, self.total, self.quiet = label, total, quiet
        self.bar = self.task = None

    def __enter__(self) -> Progress:
        if self.quiet or not sys.stderr.isatty():
            return self
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar
        except ImportError:
            return self
        self.bar = Bar(f"[bold]{self.label}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       transient=True, console=Console(stderr=True))
        self.task = self.bar.add_task(self.label, total=self.total)
        self.bar.start()
        return self

    def update(self, completed: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=completed)

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, n)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
