#!/usr/bin/env python3
"""Per-file mutation outcomes of one shard run of bench/mutants.sh (or any cargo-mutants runs).

    bench/mutants_table.py STAGE1_DIR [STAGE2_DIR ...] [--settled FILE]

Each DIR holds cargo-mutants' caught.txt, missed.txt, timeout.txt and unviable.txt: a
`mutants.out` folder, or a folder with one inside (as bench/mutants.sh's OUT/stage1), or a copy
of its lists. A mutant's outcome is its first stage's, unless a later stage (the simulator's
tests, given the earlier stage's missed mutants) caught it or timed it out. `--settled FILE`
names missed mutants settled after the runs, one a line: `NAME<TAB>killed|equivalent|removed
<TAB>why`; a killed one counts as caught, an equivalent or removed one leaves the viable count.
Prints a Markdown table: per file, viable, caught (timeouts included), missed, and the share
caught; then the totals.
"""
import collections
import os
import sys

LISTS = ("caught", "timeout", "missed", "unviable")


def fail(msg):
    sys.exit(f"mutants_table.py: {msg}")


def lines(path):
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f]
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read {path}: {e}")


def lists_dir(d):
    if not os.path.isdir(d):
        fail(f"{d} is not a folder")
    inner = os.path.join(d, "mutants.out")
    if os.path.isdir(inner):
        d = inner
    if not any(os.path.isfile(os.path.join(d, k + ".txt")) for k in LISTS):
        fail(f"{d} holds none of {', '.join(k + '.txt' for k in LISTS)}")
    return d


def outcomes(dirs):
    outcome = {}
    for i, d in enumerate(dirs):
        d = lists_dir(d)
        for kind in LISTS:
            p = os.path.join(d, kind + ".txt")
            if not os.path.exists(p):
                continue
            for m in lines(p):
                if not m.strip():
                    continue
                # A later stage can only catch what an earlier one missed; a mutant new to it
                # (cargo-mutants' unfiltered "delete field" ones) takes its outcome there.
                if i == 0 or m not in outcome or kind in ("caught", "timeout"):
                    outcome[m] = "caught" if kind == "timeout" else kind
    if not outcome:
        fail("the folders list no mutant")
    return outcome


def settled_of(path, outcome):
    if not os.path.isfile(path):
        fail(f"--settled {path} is not a file")
    settled = {}
    for n, line in enumerate(lines(path), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 3 or parts[1] not in ("killed", "equivalent", "removed") or not parts[2]:
            fail(f"{path}:{n}: want NAME<TAB>killed|equivalent|removed<TAB>why")
        name, how = parts[0], parts[1]
        if name not in outcome:
            fail(f"{path}:{n}: {name!r} is not in the runs")
        if outcome[name] != "missed":
            fail(f"{path}:{n}: {name!r} was {outcome[name]}, not missed: nothing to settle")
        if name in settled:
            fail(f"{path}:{n}: {name!r} settled twice")
        settled[name] = how
    return settled


def main(argv):
    dirs, settled_file = [], None
    it = iter(argv)
    for a in it:
        if a == "--settled":
            settled_file = next(it, None)
            if settled_file is None:
                fail("--settled needs a file")
        elif a.startswith("-"):
            fail(f"unknown option {a}\n{__doc__}")
        else:
            dirs.append(a)
    if not dirs:
        sys.exit(__doc__)
    outcome = outcomes(dirs)
    settled = settled_of(settled_file, outcome) if settled_file else {}
    rows = collections.defaultdict(collections.Counter)
    for m, o in outcome.items():
        s = settled.get(m)
        if o == "unviable" or s in ("equivalent", "removed"):
            continue
        r = rows[m.split(":", 1)[0]]
        r["viable"] += 1
        r["caught" if o == "caught" or s == "killed" else "missed"] += 1
    print("| file | viable | caught | missed | caught share |")
    print("|---|---|---|---|---|")
    total = collections.Counter()
    for f in sorted(rows):
        r = rows[f]
        total.update(r)
        print(f"| `{f}` | {r['viable']} | {r['caught']} | {r['missed']} | {100 * r['caught'] / r['viable']:.0f}% |")
    if total["viable"]:
        print(f"| all | {total['viable']} | {total['caught']} | {total['missed']} | {100 * total['caught'] / total['viable']:.1f}% |")


if __name__ == "__main__":
    main(sys.argv[1:])
