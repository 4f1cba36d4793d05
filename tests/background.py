"""Processes started in the background, so that several long runs can overlap (tests only).

A run's output goes to files, read when it is over: an unread full pipe would stall it. Several
`zmrl train` runs started together keep both cores of a 2-core machine busy, where one run's
start-up (a chain of mostly one-threaded processes) leaves one idle most of the time.
"""
from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path


@dataclasses.dataclass
class Started:
    """One started process; `finish` waits for it and returns what it printed."""

    proc: subprocess.Popen
    out: Path
    err: Path

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
