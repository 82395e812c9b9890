"""Live progress of a `specjax bench` run, on stderr (stdout carries only the report).

One `BenchProgress` follows one implementation at a time (specjax itself, then each peer):
`begin(name, total)` opens its overall count of prompt runs (warm-ups included), `stage(desc,
n)` names the configuration now running and its n prompts, `advance(k)` counts k prompts done.
Shown: the configuration, prompt i/N, the implementation's elapsed time and an ETA (elapsed ÷
done × remaining, so early ETAs, which include compilation, run long).

* stderr a terminal: a rich live display (two bars), redrawn twice a second, with the run's
  log lines printed above it;
* otherwise (a log file, CI): one plain line when an implementation starts or a new
  (suite, temperature, batch size) group begins, and at most one every `interval` seconds in
  between; never one per prompt or token.
"""

from __future__ import annotations

import time


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class BenchProgress:
    """See the module docstring. `console` is a rich Console on stderr; `clock` (seconds, for
    tests) defaults to `time.monotonic`. Usable as a context manager; `log(text)` prints a line
    without breaking the display."""

    def __init__(self, console, interval: float = 20.0, clock=time.monotonic):
        self.console = console
        self.interval = interval
        self.clock = clock
        self.live = bool(getattr(console, "is_terminal", False))
        self._progress = None
        self._overall = self._current = None
        self.name, self.total, self.done, self.t0 = "", 0, 0, 0.0
        self.desc, self.n, self.i = "", 0, 0
        self._last_line = None
        self._group = None

    # -- lifetime ---------------------------------------------------------------------------
    def __enter__(self) -> BenchProgress:
        if self.live:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("elapsed"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
                refresh_per_second=2,
                transient=True,
            )
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def log(self, text: str) -> None:
        self.console.log(text)

    # -- events -----------------------------------------------------------------------------
    def begin(self, name: str, total: int, desc: str = "") -> None:
        """A new implementation's run: `total` prompt runs in all (0: not known yet); `desc`
        says what it does until its first stage."""
        self.name, self.total, self.done, self.t0 = name, max(int(total), 0), 0, self.clock()
        self.desc, self.n, self.i, self._group = desc, 0, 0, None
        if self._progress is not None:
            for task in (self._overall, self._current):
                if task is not None:
                    self._progress.remove_task(task)
            self._overall = self._progress.add_task(f"{name}: all configurations", total=self.total or None)
            self._current = self._progress.add_task(f"{name}: {desc or 'starting'}", total=None)
        else:
            self._line(force=True)

    def stage(self, desc: str, n: int, group=None) -> None:
        """The configuration now running (`desc`) over `n` prompts. A `group` different from the
        previous stage's (e.g. (suite, temperature, batch size)) forces a plain line."""
        self.desc, self.n, self.i = desc, int(n), 0
        if self._progress is not None:
            self._progress.reset(self._current, total=self.n or None, description=f"{self.name}: {desc}")
        else:
            new_group = group is not None and group != self._group
            self._group = group if group is not None else self._group
            self._line(force=new_group)

    def advance(self, k: int = 1) -> None:
        """k prompts of the current stage are done."""
        self.i += k
        self.done += k
        if self._progress is not None:
            self._progress.update(self._current, advance=k)
            self._progress.update(self._overall, advance=k)
        else:
            self._line()

    # -- plain lines ------------------------------------------------------------------------
    def eta(self) -> float | None:
        """Seconds left for the current implementation, or None before the first prompt."""
        if not self.done or not self.total:
            return None
        return (self.clock() - self.t0) / self.done * max(self.total - self.done, 0)

    def line(self) -> str:
        """The plain status line: `name: desc, prompt i/N (done/total prompt runs), elapsed
        h:mm:ss, ETA h:mm:ss` (i is the prompt running now)."""
        text = f"{self.name}: {self.desc or 'starting'}"
        if self.n:
            text += f", prompt {min(self.i + 1, self.n)}/{self.n}"
        if self.total:
            text += f" ({self.done}/{self.total} prompt runs)"
        eta = self.eta()
        return text + f", elapsed {_clock(self.clock() - self.t0)}, ETA {'?' if eta is None else _clock(eta)}"

    def _line(self, force: bool = False) -> None:
        now = self.clock()
        if force or self._last_line is None or now - self._last_line >= self.interval:
            self._last_line = now
            self.console.print(self.line(), highlight=False, soft_wrap=True)
