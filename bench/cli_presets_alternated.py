#!/usr/bin/env python3
"""Two builds of the `tensorferry` command, before and after a change, alternated over the
bench presets tiny-20k, tiny-100k and gpt2 in one run; prints each row's median (ms) per
build and its % of the roof measured in the same run.

    python bench/cli_presets_alternated.py OLD_BIN NEW_BIN ROUNDS REPEAT OUTFILE

Each round runs `BIN bench --preset P --repeat REPEAT` for every preset and both builds,
the builds' order swapped every round."""
import subprocess, sys, re, statistics, datetime, os
old, new, rounds, repeat, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
presets = ["tiny-20k", "tiny-100k", "gpt2"]
res = {}  # (label, preset, row) -> [(ms, roofpct)]
log = open(out, "w")
def say(s):
    print(s); log.write(s + "\n"); log.flush()
say(f"# cli_presets_alternated {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC; old={old} new={new}; rounds={rounds}, each `bench --preset P --repeat {repeat}`; order alternates per round")
say(f"# load at start: {open('/proc/loadavg').read().strip()}")
for r in range(rounds):
    order = [("old", old), ("new", new)] if r % 2 == 0 else [("new", new), ("old", old)]
    for preset in presets:
        for label, b in order:
            p = subprocess.run([b, "bench", "--preset", preset, "--repeat", repeat], capture_output=True, text=True)
            seen = {}
            for line in p.stdout.splitlines():
                m = re.match(r"^(\S.*?)\s{2,}([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(.*?)\s+(\d+%|-|roof mismeasured)\s*$", line)
                if not m: continue
                name = m.group(1).strip(); roof = m.group(5).strip()
                key = name + (" | " + roof if roof != "-" else "")
                if key in seen: continue
                seen[key] = 1
                pct = m.group(6)
                res.setdefault((label, preset, key), []).append((float(m.group(2)), pct))
            say(f"round {r+1} {preset} {label}: rc={p.returncode} rows={len(seen)}")
say(f"# load at end: {open('/proc/loadavg').read().strip()}")
for preset in presets:
    say(f"\n## {preset}: median ms (and % of roof) over {rounds} runs, old -> new, new/old")
    keys = [k for (l, p, k) in res if l == "old" and p == preset]
    for k in keys:
        o = res.get(("old", preset, k), []); n = res.get(("new", preset, k), [])
        if not o or not n: continue
        om = statistics.median(x[0] for x in o); nm = statistics.median(x[0] for x in n)
        op = ",".join(x[1] for x in o); np_ = ",".join(x[1] for x in n)
        say(f"{k:55} {om:9.2f} -> {nm:9.2f}  x{nm/om:5.2f}   roof% old [{op}] new [{np_}]")
