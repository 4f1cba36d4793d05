"""Processes started in the background, so that several long runs can overlap (tests only).

A run's output goes to files, read when it is over: an unread full pipe would stall it. Several
`zmrl train` runs started together keep both cores of a 2-core machine busy, where one run's
start-up (a chain of mostly one-threaded processes) leaves one idle most of the time. Runs too large
for all of them to fit in memory at once go through a `Queue`, a few at a time.
"""
from __future__ import annotations

import dataclasses
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


@dataclasses.dataclass
class Started:
    """One started process; `finish` waits for it and returns what it printed."""

    proc: subprocess.Popen
    out: Path
    err: Path
    began: float = dataclasses.field(default_factory=time.monotonic)

    def finish(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait up to `timeout` seconds (then kill it) -> its exit code, stdout and stderr."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        return subprocess.CompletedProcess(self.proc.args, code, self.out.read_text(), self.err.read_text())

    def kill(self) -> None:
        """Stop it if it still runs (a test that failed early must not leave a run behind)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start(cmd: list[str], logs: Path, *, env: dict | None = None, cwd: Path | None = None) -> Started:
    """Start cmd, its stdout and stderr going to logs/out.txt and logs/err.txt."""
    out, err = logs / "out.txt", logs / "err.txt"
    with open(out, "w") as out_file, open(err, "w") as err_file:
        proc = subprocess.Popen(cmd, stdout=out_file, stderr=err_file, text=True, env=env, cwd=cwd)
    return Started(proc, out, err)


class Queue:
    """Named runs started at most `at_once` at a time, in the order given, the next one as soon as
    one ends. `result(name)` waits for a run; a run still going `timeout` seconds after its start is
    killed."""

    def __init__(self, starts: dict[str, Callable[[], Started]], *, at_once: int, timeout: float):
        self._names = list(starts)
        self._waiting = list(starts.items())
        self._running: dict[str, Started] = {}
        self._done: dict[str, subprocess.CompletedProcess] = {}
        self._timeout = timeout
        for _ in range(min(at_once, len(self._waiting))):
            self._start_next()

    def _start_next(self) -> None:
        name, start_run = self._waiting.pop(0)
        self._running[name] = start_run()

    def _collect_ended(self) -> None:
        for name, run in list(self._running.items()):
            if run.proc.poll() is not None or time.monotonic() - run.began > self._timeout:
                self._done[name] = run.finish(timeout=0)  # kills one still running (over time)
                del self._running[name]
                if self._waiting:
                    self._start_next()

    def result(self, name: str) -> subprocess.CompletedProcess:
        """Wait for run `name` -> its exit code, stdout and stderr."""
        if name not in self._names:
            raise KeyError(f"no run named {name!r} in this queue")
        while name not in self._done:
            self._collect_ended()
            if name not in self._done:
                time.sleep(1)
        return self._done[name]

    def finish_all(self) -> None:
        """Wait for every run, started or not yet (a test that failed early leaves none behind)."""
        for name in self._names:
            self.result(name)
