"""The ``tensorferry`` command that ``pip install tensorferry`` puts on PATH, run as a user
runs it: the console script in a subprocess, on files written by torch.save and tf.save."""

import json
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
import sysconfig
import threading
import time

import numpy as np
import pytest
from _trees import assert_same

import tensorferry as tf
from tensorferry import _native


def _script():
    """The console script installed with this package: in the interpreter's scripts folder,
    or in the ``bin`` beside the package for ``pip install --target``."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(tf.__file__)))
    for folder in (sysconfig.get_path("scripts"), os.path.join(here, "bin")):
        path = os.path.join(folder, "tensorferry")
        if os.path.isfile(path):
            return path
    found = shutil.which("tensorferry")
    assert found, f"no tensorferry console script in {sysconfig.get_path('scripts')} or on PATH"
    return found


def run(*args, timeout=120, **kwargs):
    return subprocess.run([_script(), *map(str, args)], capture_output=True, text=True, timeout=timeout, **kwargs)


def header(path):
    """The JSON header of a safetensors file, parsed by hand."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def stored(*paths):
    """Tensors, bytes, and (tensors, bytes) per safetensors dtype code that the files store."""
    count, total, per = 0, 0, {}
    for path in paths:
        for name, entry in header(path).items():
            if name == "__metadata__":
                continue
            n = entry["data_offsets"][1] - entry["data_offsets"][0]
            count, total = count + 1, total + n
            t, b = per.get(entry["dtype"], (0, 0))
            per[entry["dtype"]] = (t + 1, b + n)
    return count, total, per


_CODES = {"float32": "F32", "int64": "I64", "float16": "F16", "bfloat16": "BF16"}


# -- the native command through the console script ------------------------------------------


def test_the_console_script_is_the_native_command_with_its_version_and_help():
    out = run("--version")
    assert (out.returncode, out.stdout, out.stderr) == (0, f"tensorferry {tf.__version__}\n", "")
    out = run("--help")
    assert out.returncode == 0
    for command in ("info", "inspect", "convert", "bench"):
        assert f"\n  {command} " in out.stdout, out.stdout


def test_a_command_line_it_cannot_parse_is_status_2():
    out = run("inspekt", "x")
    assert out.returncode == 2
    assert "unrecognized subcommand 'inspekt'" in out.stderr


def test_info_lists_the_host_and_the_cuda_state():
    out = run("info")
    assert out.returncode == 0, out.stderr
    assert "devices: cpu" in out.stdout and "cuda: " in out.stdout


def test_inspect_prints_totals_per_dtype_as_the_file_stores_them(tmp_path):
    path = tmp_path / "m.safetensors"
    tf.save(
        {
            "w": np.ones((3, 4), np.float32),
            "ids": np.arange(5, dtype=np.int64),
            "block": {"scale": np.ones(2, np.float16), "bias": np.zeros(7, np.float32)},
            "step": 3,
        },
        path,
    )
    count, total, per = stored(path)
    doc = json.loads(run("inspect", "--json", path).stdout)
    assert (doc["total_tensors"], doc["total_bytes"]) == (count, total) == (4, 48 + 40 + 4 + 28)
    assert {_CODES[d]: (v["tensors"], v["bytes"]) for d, v in doc["dtypes"].items()} == per
    assert [r["path"] for r in doc["tensors"]] == [["w"], ["ids"], ["block", "scale"], ["block", "bias"]]
    table = run("inspect", path).stdout.splitlines()
    assert "4 tensors, 120 bytes (120 B)" in table
    assert "  float32: 2 tensors, 76 bytes (76 B)" in table
    assert "  float16: 1 tensor, 4 bytes (4 B)" in table


def test_inspect_of_a_sharded_checkpoint_totals_every_shard_by_folder_or_index(tmp_path):
    tf.save({f"layer.{i}.weight": np.full((50, 10), i, np.float32) for i in range(6)}, tmp_path / "model.safetensors",
            max_shard_size=4000)
    shards = sorted(p for p in os.listdir(tmp_path) if p.startswith("model-"))
    assert len(shards) == 3, shards
    count, total, _ = stored(*(tmp_path / s for s in shards))
    for target in (tmp_path, tmp_path / "model.safetensors.index.json"):
        doc = json.loads(run("inspect", "--json", target).stdout)
        assert (doc["total_tensors"], doc["total_bytes"]) == (count, total) == (6, 12000)
        assert [s["file"] for s in doc["shards"]] == shards
        assert [(s["tensors"], s["bytes"]) for s in doc["shards"]] == [stored(tmp_path / s)[:2] for s in shards]


def test_a_failure_is_one_line_on_stderr_and_status_1(tmp_path):
    out = run("inspect", tmp_path / "missing.safetensors")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("tensorferry: ") and out.stderr.count("\n") == 1, out.stderr
    assert "No such file or directory" in out.stderr


def test_a_reader_that_stops_early_ends_the_command_quietly_with_status_0(tmp_path):
    path = tmp_path / "many.safetensors"
    tf.save({f"model.layers.{i}.self_attn.q_proj.weight": np.zeros(1, np.float32) for i in range(20_000)}, path)
    child = subprocess.Popen([_script(), "inspect", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout.readline().startswith(b"path")
    child.stdout.close()
    assert child.wait(timeout=60) == 0
    assert child.stderr.read() == b""


def test_cli_main_releases_the_gil_while_the_command_runs(capfd):
    status = []
    worker = threading.Thread(
        target=lambda: status.append(_native.cli_main(["tensorferry", "bench", "--preset", "tiny-1k", "--scale", "0.05",
                                                       "--repeat", "3"])))
    ticks = 0
    worker.start()
    while worker.is_alive():
        ticks += 1
        time.sleep(0.001)
    worker.join()
    assert status == [0], capfd.readouterr().err
    assert ticks > 10, "Python did not run while the command did"
    assert "roofs measured in this run" in capfd.readouterr().out


def test_the_native_convert_says_in_one_line_that_it_runs_from_the_python_package(capfd):
    assert _native.cli_main(["tensorferry", "convert", "pytorch_model.bin"]) == 1
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "pip install tensorferry torch" in err, err


# -- progress --------------------------------------------------------------------------------


def run_on_a_terminal(*args, timeout=120):
    """Runs the command with stderr on a pseudo-terminal; returns (status, stdout, what the
    terminal showed)."""
    main, secondary = pty.openpty()
    child = subprocess.Popen([_script(), *map(str, args)], stdout=subprocess.PIPE, stderr=secondary)
    os.close(secondary)
    shown = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            shown += chunk
        elif child.poll() is not None:
            break
    os.close(main)
    out = child.stdout.read()
    return child.wait(timeout=timeout), out.decode(), shown.decode(errors="replace")


def test_bench_shows_a_bar_on_a_terminal_and_none_in_a_pipe():
    args = ("bench", "--preset", "tiny-1k", "--scale", "0.05", "--repeat", "1")
    status, out, shown = run_on_a_terminal(*args)
    assert status == 0 and "roofs measured in this run" in out
    assert "/10 " in shown, shown  # the steps bar: `3/10 consolidate`
    piped = run(*args)
    assert piped.returncode == 0 and piped.stderr == ""


# -- convert ---------------------------------------------------------------------------------


def _gpt2(transformers, torch):
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval(), config


def _logits(model, torch):
    with torch.no_grad():
        return model(torch.arange(8).reshape(1, 8)).logits


def test_convert_turns_a_torch_save_of_gpt2_into_a_file_tf_load_and_transformers_read(tmp_path, torch):
    transformers = pytest.importorskip("transformers")
    model, config = _gpt2(transformers, torch)
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
    torch.save(sd, tmp_path / "pytorch_model.bin")
    out_dir = tmp_path / "converted"
    out = run("convert", tmp_path / "pytorch_model.bin", f"{out_dir}{os.sep}")
    assert out.returncode == 0, out.stderr
    target = out_dir / "model.safetensors"
    unique = {t.data_ptr(): t.nbytes for t in sd.values()}
    assert out.stdout.splitlines()[0] == (
        f"wrote {target}: {len(unique)} tensors, {sum(unique.values())} bytes "
        f"({sum(unique.values()) / 1000:.1f} KB)"
    )
    assert "1 tied tensor stored once, loaded back shared: lm_head.weight = transformer.wte.weight" in out.stdout
    assert out.stderr == ""  # no terminal: no bar

    loaded = tf.load(target, like="torch")
    assert_same(loaded, dict(sd))  # a file holds the OrderedDict as a dict
    assert loaded["lm_head.weight"] is loaded["transformer.wte.weight"]
    count, total, _ = stored(target)
    assert (count, total) == (len(unique), sum(unique.values()))
    config.save_pretrained(out_dir)
    again = transformers.GPT2LMHeadModel.from_pretrained(out_dir).eval()
    assert torch.equal(_logits(again, torch), _logits(model, torch))


def test_convert_writes_shards_and_an_index_that_transformers_reads(tmp_path, torch):
    transformers = pytest.importorskip("transformers")
    model, config = _gpt2(transformers, torch)
    sd = model.state_dict()
    torch.save(sd, tmp_path / "pytorch_model.bin")
    out = run("convert", tmp_path, "--max-shard-size", "20KB")
    assert out.returncode == 0, out.stderr
    index = tmp_path / "model.safetensors.index.json"
    assert out.stdout.startswith(f"wrote {index}: ")
    shards = sorted(p for p in os.listdir(tmp_path) if p.startswith("model-") and p.endswith(".safetensors"))
    assert len(shards) > 2
    assert all(os.path.getsize(tmp_path / s) < 20_000 + 4096 or stored(tmp_path / s)[0] == 1 for s in shards)
    assert_same(tf.load(tmp_path, like="torch"), dict(sd))
    doc = json.loads(run("inspect", "--json", tmp_path).stdout)
    assert doc["total_bytes"] == sum({t.data_ptr(): t.nbytes for t in sd.values()}.values())
    config.save_pretrained(tmp_path)
    os.remove(tmp_path / "pytorch_model.bin")
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert torch.equal(_logits(again, torch), _logits(model, torch))


def test_convert_reads_sharded_pickles_through_their_index(tmp_path, torch):
    sd = {f"h.{i}.weight": torch.full((4, 4), float(i)) for i in range(5)}
    weight_map = {}
    for n, names in enumerate((["h.0.weight", "h.1.weight"], ["h.2.weight", "h.3.weight", "h.4.weight"]), 1):
        file = f"pytorch_model-0000{n}-of-00002.bin"
        # A stray tensor the index does not name in this file is left out.
        torch.save({**{k: sd[k] for k in names}, "stray": torch.zeros(1)}, tmp_path / file)
        weight_map.update({k: file for k in names})
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {"total_size": 5 * 64}, "weight_map": weight_map}))
    out = run("convert", tmp_path)
    assert out.returncode == 0, out.stderr
    assert_same(tf.load(tmp_path / "model.safetensors", like="torch"), sd)


@pytest.mark.parametrize("weight_map", [["pytorch_model-00001.bin"], {"w": 3}, "x"])
def test_convert_names_an_index_whose_weight_map_is_no_map_of_files(weight_map, tmp_path, torch):
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    out = run("convert", tmp_path / "pytorch_model.bin.index.json", tmp_path / "out/")
    assert out.returncode == 1, out
    assert out.stderr.startswith("tensorferry: ") and "not an index of checkpoint shards" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_convert_keeps_nesting_and_plain_values(tmp_path, torch):
    ckpt = {"model": {"w": torch.ones(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, "epoch": 3, "name": "run-1",
            "betas": (0.9, 0.999), "done": False, "none": None, "layers": [torch.arange(4), torch.arange(2)]}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    out = run("convert", tmp_path / "ckpt.pt")
    assert out.returncode == 0, out.stderr
    back = tf.load(tmp_path / "ckpt.safetensors", like="torch")
    assert {k: back[k] for k in ("epoch", "name", "betas", "done", "none")} == {
        "epoch": 3, "name": "run-1", "betas": (0.9, 0.999), "done": False, "none": None}
    assert torch.equal(back["model"]["w"], ckpt["model"]["w"]) and back["model"]["b"].dtype == torch.bfloat16
    assert [t.tolist() for t in back["layers"]] == [[0, 1, 2, 3], [0, 1]]


def test_convert_reads_the_legacy_format_too(tmp_path, torch):
    torch.save({"w": torch.arange(6.0)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    out = run("convert", tmp_path / "old.pt", tmp_path / "new.safetensors")
    assert out.returncode == 0, out.stderr
    assert tf.load(tmp_path / "new.safetensors")["w"].tolist() == [0, 1, 2, 3, 4, 5]


def test_convert_writes_overlapping_views_as_copies_and_keeps_parameters_as_tensors(tmp_path, torch):
    base = torch.arange(12.0)
    torch.save({"all": base, "part": base[4:8], "t": base.view(3, 4).t(), "p": torch.nn.Parameter(torch.ones(2))},
               tmp_path / "views.pt")
    out = run("convert", tmp_path / "views.pt")
    assert out.returncode == 0, out.stderr
    assert "2 views overlapping another tensor's memory written as copies: part, t" in out.stdout
    back = tf.load(tmp_path / "views.safetensors", like="torch")
    assert torch.equal(back["part"], base[4:8]) and torch.equal(back["t"], base.view(3, 4).t())
    assert back["p"].tolist() == [1.0, 1.0]


def _assert_refused(out, *words):
    assert out.returncode == 1 and out.stdout == "", out
    assert out.stderr.startswith("tensorferry: ") and out.stderr.count("\n") == 1, out.stderr
    for word in words:
        assert word in out.stderr, out.stderr


def test_convert_never_runs_code_from_a_pickle(tmp_path, torch):
    import argparse

    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)}, tmp_path / "full.pt")
    _assert_refused(run("convert", tmp_path / "full.pt"), "weights_only=True", "argparse.Namespace",
                    "never runs code")
    assert os.listdir(tmp_path) == ["full.pt"]


def test_convert_refuses_a_leaf_a_file_cannot_hold_naming_its_key(tmp_path, torch):
    torch.save({"model": {"w": torch.ones(2), "kind": torch.float16}}, tmp_path / "odd.pt")
    _assert_refused(run("convert", tmp_path / "odd.pt"), "'model.kind'", "torch.dtype")
    assert os.listdir(tmp_path) == ["odd.pt"]


def test_convert_refuses_a_file_that_is_not_a_checkpoint(tmp_path, torch):
    (tmp_path / "notes.bin").write_bytes(b"not a pickle at all")
    _assert_refused(run("convert", tmp_path / "notes.bin"), "notes.bin", "not a PyTorch checkpoint")


def test_convert_leaves_an_existing_output_unless_told_to_overwrite(tmp_path, torch):
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    tf.save({"old": np.zeros(1, np.float32)}, tmp_path / "model.safetensors")
    _assert_refused(run("convert", tmp_path), "model.safetensors exists", "--overwrite")
    assert list(tf.load(tmp_path / "model.safetensors")) == ["old"]
    assert run("convert", tmp_path, "--overwrite").returncode == 0
    assert list(tf.load(tmp_path / "model.safetensors")) == ["w"]


def test_convert_help_and_usage_errors_come_from_its_own_parser(tmp_path):
    out = run("convert", "--help")
    assert out.returncode == 0 and "--max-shard-size SIZE" in out.stdout and "weights_only" in out.stdout
    out = run("convert")
    assert out.returncode == 2 and "the following arguments are required: input" in out.stderr


def test_convert_shows_a_bar_of_bytes_on_a_terminal_and_none_in_a_pipe(tmp_path, torch):
    torch.save({f"w{i}": torch.ones(4 << 20) for i in range(8)}, tmp_path / "big.pt")  # 128 MiB
    status, out, shown = run_on_a_terminal("convert", tmp_path / "big.pt")
    assert status == 0, shown
    assert out.startswith(f"wrote {tmp_path / 'big.safetensors'}: 8 tensors, 134217728 bytes")
    assert "writing big.safetensors" in shown and "MiB" in shown, shown
    piped = run("convert", tmp_path / "big.pt", "--overwrite")
    assert piped.returncode == 0 and piped.stderr == ""


def test_convert_without_torch_says_what_to_install(tmp_path):
    # An interpreter that cannot import torch: a folder shadowing it with a failing import.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "torch.py").write_text("raise ImportError('no torch here')\n")
    (tmp_path / "w.pt").write_bytes(b"")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), *sys.path])}
    _assert_refused(run("convert", tmp_path / "w.pt", env=env), "pip install torch")
