"""Real torch.distributed ranks (gloo, loopback) for the multi-rank DCP tests.

``run_ranks(scenario, world, folder)`` starts ``world`` processes of this file, each
joining one process group and running every step of ``scenario`` in turn (one group for
many checks: starting ranks is the slow part). Each rank writes what it measured to
``folder/results/<scenario>_<rank>.json``; a failed check fails the rank.

The state is an FSDP2 model (``fully_shard`` on a CPU mesh) with its Adam state after one
step, and a DTensor sharded by columns. Rank 0 of the saving group writes the full
tensors to ``truth.pt`` with ``torch.save`` (gathered by ``full_tensor()``, not through
DCP), which every load, on any number of ranks, is compared with exactly.
"""

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import _ranks
from _trees import assert_same

RANK_TIMEOUT_S = 120
PG_TIMEOUT_S = 20
KILLED_RANK = 3
FAILING_RANK = 2


def run_ranks(scenario, world, folder, expect_killed=None):
    """Runs ``scenario`` on ``world`` ranks; returns ``{rank: results}``. Every rank must
    exit 0, except ``expect_killed``, which must die by SIGKILL."""
    return _ranks.run_ranks(
        __file__, scenario, world, folder, timeout=RANK_TIMEOUT_S, expect_killed=expect_killed,
        results_of_killed=True,
    )


# ---- the state -------------------------------------------------------------------------

def full_cols():
    import torch

    # 10 columns: 3/3/3/1 over 4 ranks, 5/5 over 2.
    return (torch.arange(6 * 10, dtype=torch.int64) * 7 - 100).reshape(6, 10)


def build(mesh, seed, lr):
    """An FSDP2-sharded model, its Adam optimizer after one step, and the state dict DCP
    saves: ``{"model", "optim", "extra"}``."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 384), torch.nn.ReLU(), torch.nn.Linear(384, 10))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    model(torch.randn(8, 512)).square().mean().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    cols = full_cols() if seed == 0 else torch.zeros(6, 10, dtype=torch.int64)
    extra = {"cols": distribute_tensor(cols, mesh, [Shard(1)])}
    return model, optim, {"model": msd, "optim": osd, "extra": extra}


def full(state):
    """The state with every DTensor gathered (a collective: every rank calls it)."""
    import torch

    if isinstance(state, dict):
        return {k: full(v) for k, v in state.items()}
    if isinstance(state, list):
        return [full(v) for v in state]
    if hasattr(state, "full_tensor"):
        return state.full_tensor()
    if torch.is_tensor(state):
        return state.clone()
    return state


def stats_dict(reader):
    s = reader.read_stats
    return {"needed": s.needed, "data": s.data, "header": s.header, "files": s.files}


# ---- scenarios -------------------------------------------------------------------------

def _expect_checkpoint_failure(fn, cause):
    """``fn`` must raise DCP's CheckpointException (every rank sees it); returns
    ``{failed rank: exception type name}`` that it carries."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn()
    except CheckpointException as e:
        return {str(r): type(v[0] if isinstance(v, tuple) else v).__name__ for r, v in e.failures.items()}
    raise AssertionError(f"expected a CheckpointException carrying {cause}")


def _load_and_check(mesh, ckpt, truth, seed):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from tensorferry.dcp import TensorferryReader

    model, optim, state = build(mesh, seed=seed, lr=0.5)
    reader = TensorferryReader(ckpt)
    dcp.load(state, storage_reader=reader)
    assert_same(full(state), truth)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert optim.param_groups[0]["lr"] == truth["optim"]["param_groups"][0]["lr"]
    return stats_dict(reader)


def scenario_four(rank, world, folder, mesh):
    """Save on 4 (overwrite=False refused next), load on 4; async_save with the stager; a write failing on one rank
    fails the save everywhere and keeps the checkpoint; last, one rank is killed mid-save by the first save's writer,
    used again."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tensorferry.dcp import TensorferryWriter

    class KillableWriter(TensorferryWriter):
        """Kills its process (SIGKILL) on KILLED_RANK part-way through write_data, once
        ``kill`` is set."""

        kill = False

        def write_data(self, plan, planner):
            if self.kill and dist.get_rank() == KILLED_RANK:
                threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGKILL)).start()
                super().write_data(plan, planner)
                time.sleep(60)
            return super().write_data(plan, planner)

    ckpt = os.path.join(folder, "ckpt")
    out = {}
    out["t0"] = time.time()
    _, _, state = build(mesh, seed=0, lr=1e-2)
    truth = full(state)
    if rank == 0:
        torch.save(truth, os.path.join(folder, "truth.pt"))
    writer = KillableWriter(ckpt)  # used again, last, for the save that is killed
    dcp.save(state, storage_writer=writer)
    dist.barrier()
    out["load4"] = _load_and_check(mesh, ckpt, truth, seed=1)

    # async_save staged by TensorferryStager: the snapshot is taken before it returns, so
    # changing the tensors right after does not reach the checkpoint.
    from tensorferry.dcp import TensorferryStager

    stager = TensorferryStager()
    start = time.perf_counter()
    response = dcp.async_save(state, storage_writer=TensorferryWriter(ckpt + "_async"), async_stager=stager)
    out["async_blocked_s"] = time.perf_counter() - start
    with torch.no_grad():
        for t in state["model"].values():
            t.to_local().add_(1.0)
    getattr(response, "upload_completion", response).result(timeout=60)
    stager.close()
    dist.barrier()
    out["load4_async"] = _load_and_check(mesh, ckpt + "_async", truth, seed=1)
    with torch.no_grad():
        for t in state["model"].values():
            t.to_local().sub_(1.0)

    out["overwrite_false"] = _expect_checkpoint_failure(
        lambda: dcp.save(state, storage_writer=TensorferryWriter(ckpt, overwrite=False)), "TensorferryFileExistsError")

    class FailingWriter(TensorferryWriter):
        def write_data(self, plan, planner):
            if dist.get_rank() == FAILING_RANK:
                raise OSError(28, "No space left on device (injected)")
            return super().write_data(plan, planner)

    _, _, other = build(mesh, seed=2, lr=1e-2)
    out["failed_write"] = _expect_checkpoint_failure(
        lambda: dcp.save(other, storage_writer=FailingWriter(ckpt)), "OSError")
    out["load4_after_failed_write"] = _load_and_check(mesh, ckpt, truth, seed=1)
    _write(folder, "four", rank, out)

    # Killed mid-save: the last step, as the group does not survive it. The writer of the
    # first save, used again without a checkpoint_id (so DCP never calls its reset): the
    # survivors' files must not replace the committed checkpoint's.
    big = dict(other)
    big["bulk"] = torch.full((4 << 20,), float(rank))  # 16 MiB per rank: the write takes a while
    writer.kill = True
    start = time.perf_counter()
    try:
        dcp.save(big, storage_writer=writer)
        out["killed"] = "saved"
    except Exception as e:  # the survivors see the dead peer
        out["killed"] = type(e).__name__
    out["killed_s"] = time.perf_counter() - start
    _write(folder, "four", rank, out)
    os._exit(0)  # the group lost a member: no clean teardown


def full_weight():
    import torch

    return torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4) / 7


def full_odd():
    import torch

    # 5 columns over 2 ranks: shards of 3 and 2 columns.
    return (torch.arange(3 * 5, dtype=torch.int64) * 3 - 11).reshape(3, 5)


def full_bf16():
    import torch

    return torch.linspace(-2, 2, 8, dtype=torch.float32).to(torch.bfloat16)


def local_only(rank):
    import torch

    return torch.full((3,), float(rank) + 0.5, dtype=torch.float64)


def small_state(mesh, rank, fill):
    """DTensors by rows, by columns and replicated, optimizer-like values and a tensor of
    one rank only: saved and loaded on 2 ranks (``two_ckpt``)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def dt(full, placements):
        return distribute_tensor(full if fill else torch.zeros_like(full), mesh, placements)

    return {
        "model": {"w": dt(full_weight(), [Shard(0)]), "odd": dt(full_odd(), [Shard(1)]), "half": dt(full_bf16(), [Replicate()])},
        "optim": {"step": 100 if fill else 0, "lr": 3e-4 if fill else 0.0, "exp_avg": dt(full_weight() * 2, [Shard(0)])},
        f"rank{rank}": {"local": local_only(rank) if fill else torch.zeros(3, dtype=torch.float64)},
    }


def scenario_two(rank, world, folder, mesh):
    """Save and load on 2 ranks (``two_ckpt``), then load the checkpoint saved on 4
    ranks on 2 (resharding), bytes counted."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tensorferry.dcp import TensorferryReader, TensorferryWriter

    two = os.path.join(folder, "two_ckpt")
    dcp.save(small_state(mesh, rank, True), storage_writer=TensorferryWriter(two))
    dist.barrier()
    got = small_state(mesh, rank, False)
    dcp.load(got, storage_reader=TensorferryReader(two))
    assert_same(full(got), full(small_state(mesh, rank, True)))

    truth = torch.load(os.path.join(folder, "truth.pt"), weights_only=False)
    out = {"load2": _load_and_check(mesh, os.path.join(folder, "ckpt"), truth, seed=3)}
    _write(folder, "two", rank, out)


def _write(folder, scenario, rank, out):
    os.makedirs(os.path.join(folder, "results"), exist_ok=True)
    path = os.path.join(folder, "results", f"{scenario}_{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)


SCENARIOS = {"four": scenario_four, "two": scenario_two}


def main(scenario, rank, world, port, folder):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S)
    )
    mesh = init_device_mesh("cpu", (world,))
    SCENARIOS[scenario](rank, world, folder, mesh)
    dist.destroy_process_group()


if __name__ == "__main__":
    _scenario, _rank, _world, _port, _folder = sys.argv[1:6]
    main(_scenario, int(_rank), int(_world), int(_port), _folder)
