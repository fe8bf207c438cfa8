"""Run a script in a fresh Python process and read the fields of the line it prints as
`RESULT ...`: how the disk-cache tests see what a new process loads, compiles and imports."""

from __future__ import annotations

import subprocess
import sys


def result_fields(script: str, env: dict, *args: str, timeout: int = 300) -> list[str]:
    run = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, run.stdout[-2000:] + run.stderr[-2000:]
    return line[0].split()[1:]
