"""Process control: start a service in its own session, tell whether it still runs, stop
a group of them (SIGTERM, then SIGKILL after a grace period)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvrs.cli.launcher.services import REPO_ROOT
from kvrs.cli.launcher.state import ProcessRecord

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 30


def _start_ticks(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    # Field 22 (starttime); the command name in parentheses may itself contain spaces.
    return int(stat.rsplit(")", 1)[1].split()[19])


def is_running(record: ProcessRecord) -> bool:
    """True while the recorded process (not another one that got its pid) is alive."""
    _reap(record.pid)
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if record.start_ticks < 0:
        return True
    stat_path = Path(f"/proc/{record.pid}/stat")
    try:
        stat = stat_path.read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] != "Z" and int(fields[19]) == record.start_ticks


def _reap(pid: int) -> None:
    """Collects the exit status when `pid` is our own child, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _signal_group(record: ProcessRecord, sig: signal.Signals) -> None:
    if not is_running(record):
        return
    try:
        os.killpg(record.pid, sig)
    except ProcessLookupError:
        pass


def stop_processes(records: Sequence[ProcessRecord], grace_s: float) -> list[ProcessRecord]:
    """SIGTERM to every process group, SIGKILL to those alive after `grace_s`.

    Returns the records that had to be killed.
    """
    for record in records:
        _signal_group(record, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(is_running(r) for r in records):
        time.sleep(0.05)
    killed = [record for record in records if is_running(record)]
    for record in killed:
        log.warning(
            "%s (pid %d) did not stop within %.1f s; killing it", record.name, record.pid, grace_s
        )
        _signal_group(record, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(is_running(r) for r in killed):
        time.sleep(0.05)
    return killed


def spawn(
    name: str,
    kind: str,
    command: Sequence[str],
    module: str,
    address: str,
    env: Mapping[str, str],
    run_dir: Path,
    health_path: str = "",
) -> ProcessRecord:
    """Starts `command` in its own session (it outlives `kvrs up`), logging to a file."""
    log_file = run_dir / "logs" / f"{name}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        process = subprocess.Popen(
            list(command),
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO_ROOT,
        )
    return ProcessRecord(
        name=name,
        kind=kind,
        module=module,
        address=address,
        pid=process.pid,
        log_file=str(log_file),
        started_unix_ms=int(time.time() * 1000),
        start_ticks=_start_ticks(process.pid),
        health_path=health_path,
    )


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"
