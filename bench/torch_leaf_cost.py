"""Per-leaf cost of moving many small PyTorch tensors through tensorferry from Python.

    python bench/torch_leaf_cost.py [--count 10000] [--repeat 5]

Times ``tf.to_host(d, copy=True)`` on ``count`` CPU tensors of 1024 float32 (a copy, so every
leaf crosses into tensorferry and back), beside PyTorch's own ``{k: v.clone()}`` loop, and
prints microseconds per leaf. On a GPU machine it also times CUDA tensors to the host.
"""

import argparse
import time

import torch

import tensorferry as tf


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n = args.count
    d = {f"t{i}": torch.full((1024,), float(i)) for i in range(n)}
    rows = [
        ("tensorferry to_host(copy=True), CPU torch", best(lambda: tf.to_host(d, copy=True), args.repeat)),
        ("torch {k: v.clone()}", best(lambda: {k: v.clone() for k, v in d.items()}, args.repeat)),
    ]
    if torch.cuda.is_available() and "cuda:0" in tf.devices():
        g = {k: v.cuda() for k, v in d.items()}
        torch.cuda.synchronize()
        rows.append(("tensorferry to_host, CUDA torch", best(lambda: tf.to_host(g), args.repeat)))
        rows.append(("torch {k: v.cpu()}, CUDA", best(lambda: {k: v.cpu() for k, v in g.items()}, args.repeat)))
    print(f"{n} tensors of 4 KiB, best of {args.repeat}")
    for name, t in rows:
        print(f"{name:<44} {t * 1e3:9.2f} ms {t / n * 1e6:8.2f} us/leaf")


if __name__ == "__main__":
    main()
