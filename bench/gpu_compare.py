"""GPU transfers, side by side on the same tensors: tensorferry against what people use.

Device -> host (and host -> device) of state-dict-like dictionaries, for:
  - the roof: one copy of the same total bytes into pinned memory (torch, non_blocking + sync),
  - PyTorch's per-tensor loop {k: v.cpu()} / {k: v.cuda()},
  - .to(..., non_blocking=True) per tensor plus one synchronize,
  - tensordict TensorDict(d).consolidate().to("cpu") and TensorDict(d).to("cpu") (if installed),
  - accelerate send_to_device(d, "cpu") (if installed),
  - tensorferry to_host / to_numpy / to_device.
Presets: gpt2 (148 tensors, ~500 MB f32), llama-like (291 bf16 tensors, GBs; --scale to
shrink), tiny-10k (10,000 x 4 KiB), tiny-1k (1,000 x 64x64 f32). Reports GB/s and % of roof.

Usage (on a GPU machine): python bench/gpu_compare.py [--preset gpt2] [--scale 1] [--repeat 5]
Without a usable GPU it says why and exits 0.
"""

import argparse
import sys
import time

import tensorferry as tf


def presets(torch, name, scale):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g)

    def s(n):
        return max(1, int(n * scale))

    if name == "gpt2":
        e, ff = s(768), s(3072)
        d = {"wte.weight": t(50257, e), "wpe.weight": t(1024, e)}
        for i in range(12):
            d.update({
                f"h.{i}.ln_1.weight": t(e), f"h.{i}.ln_1.bias": t(e),
                f"h.{i}.attn.c_attn.weight": t(e, 3 * e), f"h.{i}.attn.c_attn.bias": t(3 * e),
                f"h.{i}.attn.c_proj.weight": t(e, e), f"h.{i}.attn.c_proj.bias": t(e),
                f"h.{i}.ln_2.weight": t(e), f"h.{i}.ln_2.bias": t(e),
                f"h.{i}.mlp.c_fc.weight": t(e, ff), f"h.{i}.mlp.c_fc.bias": t(ff),
                f"h.{i}.mlp.c_proj.weight": t(ff, e), f"h.{i}.mlp.c_proj.bias": t(e),
            })
        d["ln_f.weight"], d["ln_f.bias"] = t(e), t(e)
        return d
    if name == "llama-like":
        h, ff, bf = s(4096), s(11008), torch.bfloat16
        d = {"embed_tokens.weight": t(32000, h, dtype=bf)}
        for i in range(32):
            for proj in ("q", "k", "v", "o"):
                d[f"layers.{i}.self_attn.{proj}_proj.weight"] = t(h, h, dtype=bf)
            for proj, shape in (("gate", (ff, h)), ("up", (ff, h)), ("down", (h, ff))):
                d[f"layers.{i}.mlp.{proj}_proj.weight"] = t(*shape, dtype=bf)
            d[f"layers.{i}.input_layernorm.weight"] = t(h, dtype=bf)
            d[f"layers.{i}.post_attention_layernorm.weight"] = t(h, dtype=bf)
        d["norm.weight"], d["lm_head.weight"] = t(h, dtype=bf), t(32000, h, dtype=bf)
        return d
    if name == "tiny-10k":
        return {f"t.{i}": t(1024) for i in range(10_000)}
    if name == "tiny-1k":
        return {f"t.{i}": t(64, 64) for i in range(1000)}
    raise SystemExit(f"unknown preset {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2", choices=["gpt2", "llama-like", "tiny-10k", "tiny-1k"])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("skipped: PyTorch is not installed")
        return 0
    try:
        tf._native.ensure_device("cuda:0")
    except tf.DeviceUnavailableError as e:
        print(f"skipped: no usable GPU ({e})")
        return 0
    if not torch.cuda.is_available():
        print("skipped: no usable GPU (torch sees none)")
        return 0

    d = presets(torch, args.preset, args.scale)
    total = sum(v.numel() * v.element_size() for v in d.values())
    print(f"preset {args.preset} (scale {args.scale}): {len(d)} tensors, {total / 1e6:.1f} MB, "
          f"GPU {torch.cuda.get_device_name(0)}, best of {args.repeat}")

    def best(fn):
        times = []
        for _ in range(args.repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times)

    flat = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    roof = best(lambda: pinned.copy_(flat, non_blocking=True))
    rows = [("roof: one copy into pinned memory", roof)]
    rows.append(("torch loop {k: v.cpu()}", best(lambda: {k: v.cpu() for k, v in d.items()})))

    def nb():
        out = {k: v.to("cpu", non_blocking=True) for k, v in d.items()}
        torch.cuda.synchronize()
        return out

    rows.append(("torch .to('cpu', non_blocking=True) + sync", best(nb)))
    try:
        from tensordict import TensorDict

        td = TensorDict(d, batch_size=[])
        rows.append(("tensordict consolidate().to('cpu')", best(lambda: td.consolidate().to("cpu"))))
        rows.append(("tensordict .to('cpu')", best(lambda: td.to("cpu"))))
    except ImportError:
        print("tensordict not installed: its rows are left out")
    try:
        from accelerate.utils import send_to_device

        rows.append(("accelerate send_to_device(d, 'cpu')", best(lambda: send_to_device(d, "cpu"))))
    except ImportError:
        print("accelerate not installed: its row is left out")
    rows.append(("tensorferry to_host (torch out, pageable)", best(lambda: tf.to_host(d))))
    rows.append(("tensorferry to_host staging='on'", best(lambda: tf.to_host(d, staging="on"))))
    rows.append(("tensorferry to_host staging='off'", best(lambda: tf.to_host(d, staging="off"))))
    rows.append(("tensorferry to_host pinned=True", best(lambda: tf.to_host(d, pinned=True))))
    rows.append(("tensorferry to_numpy", best(lambda: tf.to_numpy(d))))
    host = {k: v.cpu() for k, v in d.items()}
    rows.append(("H2D: torch loop {k: v.cuda()}", best(lambda: {k: v.cuda() for k, v in host.items()})))
    rows.append(("H2D: tensorferry to_device", best(lambda: tf.to_device(host, "cuda:0"))))
    rows.append(("H2D: tensorferry staging='on'", best(lambda: tf.to_device(host, "cuda:0", staging="on"))))
    rows.append(("H2D: tensorferry staging='off'", best(lambda: tf.to_device(host, "cuda:0", staging="off"))))
    print(f"{'path':<46} {'ms':>9} {'GB/s':>7} {'% roof':>7} {'us/leaf':>8}")
    for name, t in rows:
        print(f"{name:<46} {t * 1e3:>9.2f} {total / t / 1e9:>7.2f} {roof / t * 100:>6.0f}% "
              f"{t / len(d) * 1e6:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
