"""A short run of scripts/soak.py: threads moving, saving and loading random trees while
faults are injected on the emulated devices end with right results or tensorferry errors,
never wrong data, another exception or a hang."""

import os
import re
import subprocess
import sys

SOAK = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts", "soak.py")


def _summary_numbers(line):
    return {k: int(v) for k, v in re.findall(r"\b(ops|faults_seen|wrong|unexpected|leftover_files)=(\d+)", line)}


def test_a_short_soak_under_injected_faults_gives_no_wrong_result():
    env = dict(os.environ)
    for build in ("release", "debug"):
        cli = os.path.join(os.path.dirname(SOAK), "..", "target", build, "tensorferry")
        if os.path.exists(cli):
            env.setdefault("TENSORFERRY_CLI", os.path.abspath(cli))
    run = subprocess.run(
        [sys.executable, SOAK, "--seconds", "8", "--threads", "3", "--seed", "7", "--watchdog", "20"],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    lines = run.stdout.strip().splitlines()
    assert lines, f"no summary; stderr:\n{run.stderr[-4000:]}"
    summary = lines[-1]
    assert run.returncode == 0, f"{summary}\n{run.stderr[-4000:]}"
    numbers = _summary_numbers(summary)
    assert summary.startswith("soak: PASS"), summary
    assert numbers["ops"] > 0 and numbers["faults_seen"] > 0, summary
    assert numbers["wrong"] == 0 and numbers["unexpected"] == 0 and numbers["leftover_files"] == 0, summary
