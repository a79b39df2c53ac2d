"""``tensorferry.load(..., process_group=pg)`` on real gloo ranks (loopback): every rank
gets what a plain ``tf.load`` gives while storage serves each byte once; ``shard=`` gives
each rank its ``tensor_split`` slice, reading only that slice's bytes; failures are the
same error on every rank; a rank killed mid-load fails the others, it does not hang them.

Two process groups in all (4 ranks, then 2), each running every scenario of
``_fanout_ranks.py`` in turn; each rank bounded by a deadline. The ranks check their
results against ``tf.load`` themselves; this file asserts across ranks (bytes, errors).
"""

import json
import os
import random
import struct

import pytest

torch = pytest.importorskip("torch", reason="process-group loads need PyTorch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this PyTorch build has no torch.distributed with gloo", allow_module_level=True)
pytest.importorskip("safetensors", reason="the foreign checkpoints are written by safetensors")

import _fanout_ranks as ranks  # noqa: E402
from _servers import S3Server, point_at, s3_binary_or_skip  # noqa: E402

import tensorferry as tf  # noqa: E402
from tensorferry import _fanout  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

ITEM = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fanout")
    ranks.make_checkpoints(str(folder))
    return folder


@pytest.fixture(scope="module")
def four(folder):
    return ranks.run_ranks("four", 4, folder, expect_killed=ranks.KILLED_RANK)


@pytest.fixture(scope="module")
def two(folder):
    return ranks.run_ranks("two", 2, folder)


def header(path):
    """``{name: (dtype, shape, nbytes)}`` of a safetensors file, read here by hand."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entries = json.loads(f.read(n))
    entries.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"]), v["data_offsets"][1] - v["data_offsets"][0]) for k, v in entries.items()}


def checkpoint_sizes(path):
    """``(total data bytes, largest tensor's bytes)`` of a file or of every file of a folder."""
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    sizes = [n for f in files for _, _, n in header(f).values()]
    return sum(sizes), max(sizes)


def slice_bytes(path, world, names):
    """Bytes of one rank's slice of each of ``names`` (even splits)."""
    h = header(path)
    return sum(h[n][2] // world for n in names)


# ---- every rank gets what tf.load gives, each byte read once ---------------------------------


@pytest.mark.parametrize("world", [4, 2])
def test_every_rank_gets_what_tf_load_gives_and_storage_serves_each_byte_once(world, folder, four, two):
    results = {4: four, 2: two}[world]
    for name in ("mixed.safetensors", "ts", "hf", "tp.safetensors"):
        total, largest = checkpoint_sizes(str(folder / name))
        for r in results:
            d = results[r][f"replicated:{name}"]["data"]
            # About 1/N of the file, within one tensor of balance.
            assert abs(d - total / world) <= largest, (name, r, d, total / world, largest)
            assert results[r][f"replicated:{name}"]["needed"] == d
    if world == 2:
        for name in ("mixed.safetensors", "ts", "hf", "tp.safetensors"):
            total, _ = checkpoint_sizes(str(folder / name))
            assert sum(two[r][f"replicated:{name}"]["data"] for r in (0, 1)) == total, name


def test_four_ranks_read_the_whole_checkpoint_once_between_them(four, folder):
    # Rank 3 was killed last, after it saved its results of the earlier steps.
    results = {r: four[r] for r in four}
    assert sorted(results) == [0, 1, 2]
    with open(folder / "results" / "four_3.json") as f:
        results[3] = json.load(f)
    for name in ("mixed.safetensors", "ts", "hf", "tp.safetensors", "ts/model.safetensors", "ts/model"):
        if f"replicated:{name}" not in results[0]:
            continue  # a path the native build does not resolve (the ranks checked the error)
        total, _ = checkpoint_sizes(str(folder / name.split("/")[0]))
        assert sum(results[r][f"replicated:{name}"]["data"] for r in range(4)) == total, name


def test_headers_are_counted_once_per_file_and_rank(two, folder):
    for r in (0, 1):
        assert two[r]["replicated:mixed.safetensors"]["files"] == 1
        shards = len([f for f in os.listdir(folder / "ts") if f.endswith(".safetensors")])
        assert two[r]["replicated:ts"]["files"] == shards > 1
        assert two[r]["replicated:hf"]["files"] == 2


# ---- direct=True: each rank's part read past the page cache ---------------------------------

DIRECT_BLOCK = 4096


@pytest.mark.parametrize("world", [4, 2])
def test_direct_reads_each_ranks_part_past_the_page_cache_once(world, folder, four, two):
    results = {4: four, 2: two}[world]
    for name, files in (("mixed.safetensors", 1), ("hf", 2)):
        total, largest = checkpoint_sizes(str(folder / name))
        needed = [results[r][f"direct:{name}"]["needed"] for r in results]
        for r, res in results.items():
            d = res[f"direct:{name}"]
            # About 1/N of the file; read in whole blocks: at most two more per file.
            assert abs(d["needed"] - total / world) <= largest, (name, r, d)
            assert d["needed"] <= d["data"] <= d["needed"] + 2 * DIRECT_BLOCK * files, (name, r, d)
            # This filesystem takes O_DIRECT: no fallback through the page cache.
            assert not d["warnings"], d["warnings"]
        if len(results) == world:
            assert sum(needed) == total, name
    for r, res in results.items():
        # The same slices (and replicated tensors) as the page-cache load, in whole blocks.
        d = res["direct_sharded"]
        assert d["data"] >= d["needed"] == res["sharded:tp.safetensors"]["needed"], (r, d)


# ---- DCP: a checkpoint trained with DCP, consolidated, loaded tensor-parallel --------------


@pytest.mark.parametrize("world", [4, 2])
def test_a_dcp_checkpoint_consolidated_loads_tensor_parallel_reading_only_each_ranks_shards(world, folder, four, two):
    # The ranks checked that each got back the local shards of the DTensors it saved.
    results = {4: four, 2: two}[world]
    hf = str(folder / f"dcp_{world}_hf" / "model.safetensors")
    h = header(hf)
    want = sum(h[n][2] // world for n, dim in ranks.DCP_SPLITS.items() if dim is not None)
    norm = h["norm.weight"][2]
    total, largest = checkpoint_sizes(hf)
    for r, res in results.items():
        s = res["dcp:sharded"]
        assert s["data"] == s["needed"] and s["data"] in (want, want + norm), (r, s, want)
        s = res["dcp:replicated"]
        assert s["data"] == s["needed"] and abs(s["data"] - total / world) <= largest, (r, s)
        # dcp.load through TensorferryReader on the same ranks: exactly the chunks asked for.
        s = res["dcp:reader"]
        assert s["data"] == s["needed"] > 0, (r, s)
    assert sum(res["dcp:sharded"]["data"] == want + norm for res in results.values()) <= 1


# ---- host memory per rank ----------------------------------------------------------------------


@pytest.mark.parametrize("world", [4, 2])
def test_host_memory_per_rank_is_the_result_its_part_and_one_part_in_flight(world, folder, four, two):
    # Peak RSS growth of one load per rank (the rank measured it, see memory() there).
    results = {4: four, 2: two}[world]
    data, _ = checkpoint_sizes(str(folder / "big.safetensors"))
    part, slack = data / world, 0.02 * data + (2 << 20)
    for r, res in sorted(results.items()):
        m = res["memory"]
        print(f"{world} ranks, rank {r}, peak RSS growth (MB): " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in m.items()))
        # Onto the host: the result itself (the parts received are the result's memory).
        assert m["cpu"] <= data + slack, (r, m)
        # Onto the emulated device, whose memory is host memory: the device's copy of the
        # result, the rank's own part (held until its turn to send) and the one part being
        # received — never the whole tree twice.
        assert m["emu:0"] <= data + 2 * part + slack, (r, m)
        assert data - slack <= m["plain"] <= data + slack, (r, m)


# ---- sharded loads read exactly their slices -------------------------------------------------


@pytest.mark.parametrize("world", [4, 2])
def test_a_sharded_load_reads_exactly_its_slices(world, folder, four, two):
    results = {4: four, 2: two}[world]
    sliced = [n for n, d in ranks.TP_SPLITS.items() if d is not None]
    want = slice_bytes(str(folder / "tp.safetensors"), world, sliced)
    norm = header(str(folder / "tp.safetensors"))["norm.weight"][2]
    for r, res in results.items():
        assert res["sharded_only"]["data"] == res["sharded_only"]["needed"] == want, r
        # With the one replicated tensor: its owner reads it too, nobody else does.
        for name in ("sharded:tp.safetensors", "sharded:hf"):
            assert res[name]["data"] in (want, want + norm), (r, name, res[name])
    owners = [r for r, res in results.items() if res["sharded:tp.safetensors"]["data"] == want + norm]
    assert len(owners) <= 1


def test_slice_runs_are_the_fewest_contiguous_runs():
    # dim 0: one run; a middle dim: one run per outer index; the last dim: one per row.
    assert _fanout.slice_runs((8, 6), 2, 0, 4, 1) == ([(24, 24)], (2, 6))
    assert _fanout.slice_runs((3, 8, 5), 2, 1, 2, 1) == ([(40, 40), (120, 40), (200, 40)], (3, 4, 5))
    assert _fanout.slice_runs((4, 6), 4, 1, 3, 2) == ([(16, 8), (40, 8), (64, 8), (88, 8)], (4, 2))
    # One part of one: the whole tensor in one run.
    assert _fanout.slice_runs((3, 8, 5), 2, 2, 1, 0) == ([(0, 240)], (3, 8, 5))


def test_parts_travel_on_the_gpu_only_through_a_gpu_backend_to_a_gpu():
    assert _fanout._exchange_device("gloo", "cpu") == "cpu"
    assert _fanout._exchange_device("gloo", "cuda:1") == "cpu"
    assert _fanout._exchange_device("nccl", "cuda:1") == "cuda:1"
    assert _fanout._exchange_device("cpu:gloo,cuda:nccl", "cuda:0") == "cuda:0"
    assert _fanout._exchange_device("cpu:gloo,cuda:nccl", "cpu") == "cpu"


@pytest.mark.parametrize("shared", [False, True])
def test_the_read_throttle_is_a_link_per_process_or_one_shared_by_all(shared, tmp_path, monkeypatch):
    # Two readers (threads here, processes in bench/fanout.py) each pass 4 MB at 20 MB/s:
    # 0.2 s each on links of their own, 0.4 s for both on one shared link.
    import threading
    import time

    monkeypatch.setenv(_fanout.READ_MBPS_ENV, "20")
    if shared:
        monkeypatch.setenv(_fanout.READ_LINK_ENV, str(tmp_path / "link"))
    else:
        monkeypatch.delenv(_fanout.READ_LINK_ENV, raising=False)
    ends = []
    start = time.time()

    def reader():
        _fanout._Throttle().wait(4_000_000)
        ends.append(time.time() - start)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert min(ends) >= 0.195 and (max(ends) >= 0.395 if shared else max(ends) < 0.35), ends


def test_parts_are_contiguous_in_file_order_and_balanced_within_one_tensor():
    rng = random.Random(0)
    for world in (1, 2, 3, 4, 8):
        sizes = [rng.choice([0, 2, 64, 1000, 4096, 100_000]) for _ in range(rng.randint(1, 300))]
        items, at = [], 0
        for i, n in enumerate(sizes):
            items.append(_fanout._Item((i,), str(i), "f", "U8", (n,), at, at + n, "U8"))
            at += n
        parts = _fanout._assign_owners(list(items), world, {"f": 0})
        owners = [it.owner for it in items]
        assert owners == sorted(owners)
        total = sum(sizes)
        for r in range(world):
            got = sum(it.nbytes for it in items if it.owner == r)
            assert abs(got - total / world) <= max(sizes), (world, r, got, total / world)
            mine = [it for it in items if it.owner == r]
            assert all(it.offset % _fanout.ALIGN == 0 for it in mine)
            assert parts[r] == (_fanout._aligned(mine[-1].offset + mine[-1].nbytes) if mine else 0)


# ---- errors: the same on every rank, naming the rank and the file --------------------------------


def _same_everywhere(results, key):
    seen = {(res[key]["type"], res[key]["message"]) for res in results.values()}
    assert len(seen) == 1, seen
    return results[min(results)][key]


@pytest.mark.parametrize("world", [4, 2])
def test_errors_are_the_same_on_every_rank_and_name_the_rank_and_the_file(world, four, two):
    results = {4: four, 2: two}[world]
    e = _same_everywhere(results, "error:no_such_tensor")
    assert e["type"] == "TensorferryKeyError" and "layers.*.mlp.weight" in e["message"]
    assert f"on rank 0 of {world}" in e["message"] and "tp.safetensors" in e["message"]
    e = _same_everywhere(results, "error:uneven")
    assert e["type"] == "FormatError" and "conv.weight" in e["message"] and f"multiple of {world}" in e["message"]
    e = _same_everywhere(results, "error:dim")
    assert e["type"] == "FormatError" and "norm.weight" in e["message"] and "dim 1" in e["message"]
    e = _same_everywhere(results, "error:missing_file")
    assert "FileNotFoundError" in e["mro"] and "TensorferryError" in e["mro"]
    assert f"on rank 1 of {world}" in e["message"] and "missing.safetensors" in e["message"]
    e = _same_everywhere(results, "error:missing_shard")
    assert "FileNotFoundError" in e["mro"] and "model-00002-of-00002.safetensors" in e["message"]
    assert f"on rank 0 of {world}" in e["message"] and "failed too" in e["message"]
    e = _same_everywhere(results, "error:two_saves")
    assert e["type"] == "FormatError" and "model-00002-of-00002.safetensors" in e["message"]
    assert "another save" in e["message"] and f"on rank 0 of {world}" in e["message"]
    e = _same_everywhere(results, "error:other_checkpoint")
    assert e["type"] == "FormatError" and f"rank {world - 1} (tensorferry.load(" in e["message"]
    assert "other.safetensors" in e["message"] and "sees another checkpoint" in e["message"]


def test_a_checkpoint_replaced_while_a_rank_reads_it_fails_on_every_rank(two):
    e = _same_everywhere(two, "error:replaced")
    assert e["type"] == "FormatError" and "on rank 0 of 2" in e["message"]
    assert "race_2.safetensors" in e["message"] and "replaced during the load" in e["message"]


def test_a_rank_killed_mid_load_fails_the_others_within_the_timeout(four):
    for r, res in four.items():
        e = res["error:killed"]
        assert e["type"] == "ProcessGroupError" and "RuntimeError" in e["mro"], (r, e)
        assert f"on rank {r} of 4" in e["message"] and "mixed.safetensors" in e["message"]
        assert res["killed_after_s"] < ranks.PG_TIMEOUT_S + 5, (r, res["killed_after_s"])


def test_shard_without_a_process_group_is_refused(folder):
    with pytest.raises(ValueError, match="process_group"):
        tf.load(str(folder / "tp.safetensors"), shard={"embed.weight": 0})


# ---- object storage: each rank reads its part of the objects with ranged GETs ----------------


@pytest.fixture(scope="module")
def s3_results(folder, tmp_path_factory):
    """``{world: {rank: results}}`` of the ``s3`` scenario on 4 then 2 ranks, the
    checkpoints uploaded to an s3s-fs server (``_servers.S3Server``), whose
    environment the ranks inherit."""
    server = S3Server(s3_binary_or_skip(), str(tmp_path_factory.mktemp("fanout_s3")))
    try:
        with pytest.MonkeyPatch.context() as mp:
            point_at(mp, server)
            mp.setenv("FANOUT_S3_PREFIX", "s3://bucket/fanout/")
            for name in ("mixed.safetensors", "tp.safetensors", "hf", "ts"):
                local = folder / name
                for f in [local] if local.is_file() else sorted(local.iterdir()):
                    tf._native.put(f"s3://bucket/fanout/{f.relative_to(folder)}", f.read_bytes())
            yield {world: ranks.run_ranks("s3", world, folder) for world in (4, 2)}
    finally:
        server.stop()


S3_CHECKPOINTS = {"mixed.safetensors": "mixed.safetensors", "tp.safetensors": "tp.safetensors", "hf/": "hf",
                  "hf/model.safetensors.index.json": "hf", "ts/": "ts"}


@pytest.mark.parametrize("world", [4, 2])
def test_objects_load_on_every_rank_each_rank_reading_its_part_once(world, folder, s3_results):
    # The ranks checked that each result equals tf.load(url).
    results = s3_results[world]
    assert sorted(results) == list(range(world))
    for name, local in S3_CHECKPOINTS.items():
        total, largest = checkpoint_sizes(str(folder / local))
        for r, res in results.items():
            d = res[f"s3:{name}"]
            assert d["needed"] == d["data"] and abs(d["data"] - total / world) <= largest, (name, r, d)
        assert sum(res[f"s3:{name}"]["data"] for res in results.values()) == total, name
    shards = len([f for f in os.listdir(folder / "ts") if f.endswith(".safetensors")])
    assert all(res["s3:ts/"]["files"] == shards > 1 for res in results.values())


@pytest.mark.parametrize("world", [4, 2])
def test_a_sharded_load_from_object_storage_reads_exactly_its_slices(world, folder, s3_results):
    sliced = [n for n, d in ranks.TP_SPLITS.items() if d is not None]
    want = slice_bytes(str(folder / "tp.safetensors"), world, sliced)
    for r, res in s3_results[world].items():
        assert res["s3:sharded_only"]["data"] == res["s3:sharded_only"]["needed"] == want, r


@pytest.mark.parametrize("world", [4, 2])
@pytest.mark.parametrize("case, refusal", [("index_as_shard", "is an index, not a safetensors file"),
                                           ("save_id_not_a_string", "metadata.tensorferry.save must be a string")])
def test_an_index_the_native_reader_refuses_is_refused_on_every_rank(world, s3_results, case, refusal):
    e = _same_everywhere(s3_results[world], f"error:s3_{case}")
    assert e["type"] == "FormatError" and refusal in e["message"] and f"on rank 0 of {world}" in e["message"]


@pytest.mark.parametrize("world", [4, 2])
def test_an_object_replaced_while_a_rank_reads_it_fails_on_every_rank(world, s3_results):
    e = _same_everywhere(s3_results[world], "error:s3_replaced")
    assert f"on rank 0 of {world}" in e["message"] and f"race_{world}.safetensors" in e["message"], e
    assert "replaced" in e["message"], e
