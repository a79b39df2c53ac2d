#!/usr/bin/env python3
"""Fuzzes tensorferry's DCP metadata reader (``tensorferry._dcp_metadata.parse``: the
``.metadata`` of a DCP checkpoint, a pickle read without pickle) with the fuzzer's bytes,
mutated from ``corpus-dcp-metadata/`` (real metadata of one and two ranks, and hostile
pickles: dotted globals, eval/exec, EXT, INST/OBJ, PERSID, BUILD planting
``__setstate__``, deep nesting, billion laughs, a huge memo index).

Every input must read as a DCP ``Metadata`` that passes the reader's checks or raise
``tensorferry.FormatError`` naming the input. Anything else is a finding: another
exception, a crash, a hang (``-timeout``), memory beyond ``-rss_limit_mb``, or a file
``PWNED`` appearing in the current folder (code ran).

    mkdir -p /tmp/dcp-corpus && cp fuzz/python/corpus-dcp-metadata/* /tmp/dcp-corpus/
    (cd /tmp && TF_FUZZ_FINDINGS=/tmp/dcp-findings .venv/bin/python \
        /path/to/fuzz/python/fuzz_dcp_metadata.py /tmp/dcp-corpus -max_total_time=600 -timeout=20 -rss_limit_mb=4000)
    .venv/bin/python fuzz/python/fuzz_dcp_metadata.py --replay fuzz/python/corpus-dcp-metadata/*
    .venv/bin/python fuzz/python/fuzz_dcp_metadata.py --random 60     # no atheris: mutations from random

Run it from a scratch folder: a hostile input that got through would write there.
"""

import glob
import hashlib
import os
import random
import sys
import time
import traceback

try:
    import atheris
except ImportError:
    atheris = None

if atheris is not None:
    with atheris.instrument_imports(include=["tensorferry"]):
        import tensorferry as tf
        from tensorferry import _dcp_metadata
else:
    import tensorferry as tf
    from tensorferry import _dcp_metadata

import torch.distributed.checkpoint.metadata as dcp_md

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus-dcp-metadata")
FINDINGS = os.environ.get("TF_FUZZ_FINDINGS")
_seen = set()


class Finding(Exception):
    pass


def check(data):
    """Reads ``data``; raises Finding unless it is a valid Metadata or a FormatError."""
    try:
        md = _dcp_metadata.parse(data, "input")
    except tf.FormatError as e:
        if not str(e).startswith("input: "):
            raise Finding(f"a FormatError that does not name the input: {e}") from None
    except Exception as e:  # noqa: BLE001 - anything else is what we look for
        raise Finding(f"{type(e).__name__}: {e}") from e
    else:
        if type(md) is not dcp_md.Metadata:
            raise Finding(f"read as a {type(md).__name__}")
    if os.path.exists("PWNED"):
        os.remove("PWNED")
        raise Finding("code ran: PWNED was created")


def record(data, error):
    kind = hashlib.sha1(str(error).split(":")[0].encode()).hexdigest()[:12]
    if kind in _seen:
        return
    _seen.add(kind)
    os.makedirs(FINDINGS, exist_ok=True)
    with open(os.path.join(FINDINGS, f"{kind}.bin"), "wb") as f:
        f.write(data)
    with open(os.path.join(FINDINGS, f"{kind}.txt"), "w") as f:
        f.write("".join(traceback.format_exception(error)))


def one_input(data):
    try:
        check(bytes(data))
    except Finding as e:
        if not FINDINGS:
            raise
        record(bytes(data), e)


def _seeds():
    out = []
    for path in sorted(glob.glob(os.path.join(CORPUS, "*"))):
        if os.path.getsize(path) <= 1 << 16:
            with open(path, "rb") as f:
                out.append(f.read())
    return out


def mutate(rng, seeds):
    """One mutant: a seed with a few byte flips, insertions, deletions, truncations and
    splices of other seeds' runs (opcodes that look real)."""
    data = bytearray(rng.choice(seeds))
    for _ in range(rng.randint(1, 6)):
        if not data:
            break
        at = rng.randrange(len(data))
        kind = rng.randrange(5)
        if kind == 0:
            data[at] ^= rng.randrange(1, 256)
        elif kind == 1:
            data[at:at] = rng.randbytes(rng.randint(1, 8))
        elif kind == 2:
            del data[at:at + rng.randint(1, 16)]
        elif kind == 3:
            donor = rng.choice(seeds)
            start = rng.randrange(len(donor))
            data[at:at] = donor[start:start + rng.randint(1, 64)]
        else:
            del data[at:]
    return bytes(data)


def run_random(seconds):
    rng, seeds = random.Random(0), _seeds()
    end, runs, findings = time.monotonic() + seconds, 0, 0
    while time.monotonic() < end:
        data = mutate(rng, seeds)
        runs += 1
        try:
            check(data)
        except Finding as e:
            findings += 1
            print(f"FINDING {e}")
            if FINDINGS:
                record(data, e)
    print(f"{runs} inputs, {findings} findings")
    return 1 if findings else 0


def replay(paths):
    bad = 0
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        try:
            check(data)
            try:
                _dcp_metadata.parse(data, "input")
                outcome = "read"
            except tf.FormatError as e:
                outcome = f"refused: {str(e)[7:120]}"
        except Finding as e:
            bad += 1
            outcome = f"FINDING {e}"
        print(f"{os.path.basename(path)}: {outcome}")
    return 1 if bad else 0


def main(argv):
    if argv[:1] == ["--replay"]:
        return replay(argv[1:])
    if argv[:1] == ["--random"]:
        return run_random(float(argv[1]) if len(argv) > 1 else 60)
    if atheris is None:
        print("atheris is not installed: use --random SECONDS or --replay FILE...", file=sys.stderr)
        return 2
    atheris.Setup([sys.argv[0], *argv], one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
