"""Stage processes: started with their own log file, stopped politely, then firmly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


class StageProcess:
    """One ``python -m rollout_bus.cli.<module>`` process whose output goes to ``log_path``."""

    def __init__(self, name: str, module: str, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.name = name
        self.module, self.args = module, list(args)
        self.env = env
        self.log_path = log_path
        self.command = [sys.executable, "-m", f"rollout_bus.cli.{module}", *args]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                                     start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, wait, then SIGKILL the process group; return the exit code."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL at once (tests and crash drills)."""
        self._signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def freeze(self, frozen: bool) -> None:
        """SIGSTOP (True) or SIGCONT (False): a drill holds a process still while it checks what it holds."""
        self._signal(signal.SIGSTOP if frozen else signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

