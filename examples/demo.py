"""The main job, end to end: a state-dict-like dictionary on the best device present is
moved to the host, converted to NumPy, saved and loaded back; every step is checked and
printed.

Run it with: bash scripts/demo.sh
"""

import os
import tempfile
import time

import numpy as np

import tensorferry as tf


def build(device):
    """A GPT-2-like state dict (float32), an optimizer state and plain values."""
    rng = np.random.default_rng(0)
    model = {}
    for layer in range(4):
        model[f"h.{layer}.attn.c_attn.weight"] = rng.standard_normal((256, 768), dtype=np.float32)
        model[f"h.{layer}.attn.c_attn.bias"] = np.zeros(768, np.float32)
        model[f"h.{layer}.mlp.c_fc.weight"] = rng.standard_normal((256, 1024), dtype=np.float32)
    state = {
        "model": model,
        "optimizer": {"step": 1200, "lr": 3e-4, "schedule": "cosine"},
        "batch": {"ids": [[1, 2, 3], [4, 5, 6]], "mask": [[True, True, False], [True, True, True]]},
        "run": "demo",
    }
    return tf.to_device(state, device)


def main():
    devices = tf.devices()
    gpus = [d for d in devices if d.startswith("cuda")]
    # No GPU: the emulated device runs the same transfer engine in host memory.
    device = gpus[0] if gpus else "emu:0"
    print(f"devices usable by tensorferry: {devices}; building the dictionary on {device}"
          + ("" if gpus else " (emulated: no GPU present)"))
    state = build(device)
    td = tf.TensorDict(state)
    print(f"  {len(td._tensors())} tensors, {td.nbytes / 1e6:.1f} MB, device {td.device}")

    t0 = time.perf_counter()
    host = tf.to_host(state, copy=True)
    t1 = time.perf_counter()
    print(f"to_host(copy=True): {(t1 - t0) * 1e3:.1f} ms; plain values kept: run={host['run']!r}, "
          f"step={host['optimizer']['step']}")

    arrays = tf.to_numpy(host)
    w = arrays["model"]["h.0.attn.c_attn.weight"]
    print(f"to_numpy: {type(w).__name__} {w.dtype} {w.shape}, batch ids {arrays['batch']['ids'].tolist()}")

    path = os.path.join(tempfile.mkdtemp(), "demo.safetensors")
    t0 = time.perf_counter()
    tf.save(arrays, path, metadata={"written_by": "tensorferry demo"})
    t1 = time.perf_counter()
    back = tf.load(path)
    t2 = time.perf_counter()
    size = os.path.getsize(path)
    print(f"save: {size / 1e6:.1f} MB in {(t1 - t0) * 1e3:.1f} ms; load (mmap): {(t2 - t1) * 1e3:.2f} ms")

    for name, original in arrays["model"].items():
        assert np.array_equal(back["model"][name], original), name
    assert back["optimizer"] == arrays["optimizer"] and back["run"] == "demo"
    assert back["batch"]["mask"].dtype == np.bool_
    print(f"reloaded and checked: structure, {len(arrays['model'])} model tensors, plain values, "
          f"metadata {tf.metadata(path)}")


if __name__ == "__main__":
    main()
