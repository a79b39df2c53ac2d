"""Real torch.distributed ranks (gloo, loopback) for the multi-rank tests: a script of
scenarios (``_dcp_ranks.py``, ``_fanout_ranks.py``) run as ``world`` processes, each given
``scenario rank world port folder`` on its command line and writing what it measured to
``folder/results/<scenario>_<rank>.json``."""

import json
import os
import signal
import subprocess
import sys

from _servers import free_port


def run_ranks(script, scenario, world, folder, *, timeout, expect_killed=None, results_of_killed=False):
    """Runs ``scenario`` of ``script`` on ``world`` ranks; returns ``{rank: results}``.
    Every rank must exit 0 within ``timeout`` seconds, except ``expect_killed``, which must
    die by SIGKILL (its results are read too with ``results_of_killed``)."""
    port = free_port()
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, script, scenario, str(rank), str(world), str(port), str(folder)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = {}
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        if rank == expect_killed:
            assert p.returncode == -signal.SIGKILL, f"rank {rank} was to be killed, exited {p.returncode}:\n{out[-4000:]}"
            if not results_of_killed:
                continue
        else:
            assert p.returncode == 0, f"rank {rank} failed:\n{out[-6000:]}"
        with open(os.path.join(folder, "results", f"{scenario}_{rank}.json")) as f:
            results[rank] = json.load(f)
    return results
