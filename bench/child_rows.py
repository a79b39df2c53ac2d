"""What the checkpoint benchmarks share to run each row in a process of its own: the row's
run under the whole benchmark's time budget, and the peak resident memory it adds (VmHWM
after resetting it through /proc/self/clear_refs; ru_maxrss would keep the parent's peak
across fork + exec)."""

import json
import subprocess
import sys
import time


def run_child(cmd, deadline):
    """Runs ``cmd`` (a benchmark script re-invoked on one row) before ``deadline`` (a
    ``time.monotonic()`` value): the JSON on its last line of output, or ``{"error": why}``."""
    left = deadline - time.monotonic()
    if left < 5:
        return {"error": "skipped: time budget (--budget) spent"}
    try:
        p = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        return {"error": f"killed after {left:.0f} s: time budget (--budget) spent"}
    if p.returncode:
        return {"error": "failed: " + (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def reset_peak():
    """VmHWM := VmRSS; False where /proc/self/clear_refs is missing (gVisor, say)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def status_kib(field):
    """A /proc/self/status field in KiB ("VmRSS", "VmHWM")."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
