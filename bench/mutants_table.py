#!/usr/bin/env python3
"""Per-file mutation outcomes of one shard run of bench/mutants.sh (or any cargo-mutants runs).

    bench/mutants_table.py STAGE1_DIR [STAGE2_DIR ...] [--settled FILE]

Each DIR holds cargo-mutants' caught.txt, missed.txt, timeout.txt and unviable.txt (a
`mutants.out` folder, or a copy of its lists). A mutant's outcome is its first stage's, unless a
later stage (the simulator's tests, given the earlier stage's missed mutants) caught it or timed
it out. `--settled FILE` names mutants settled after the runs, one a line:
`NAME<TAB>killed|equivalent|removed<TAB>why`; a killed one counts as caught, an equivalent or
removed one leaves the viable count. Prints a Markdown table: per file, viable, caught (timeouts
included), missed, and the share caught; then the totals.
"""
import collections
import os
import sys


def read(d, name):
    p = os.path.join(d, name)
    if not os.path.exists(p):
        return []
    with open(p) as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def main(argv):
    dirs, settled_file = [], None
    it = iter(argv)
    for a in it:
        if a == "--settled":
            settled_file = next(it, None)
            if settled_file is None:
                sys.exit("mutants_table.py: --settled needs a file")
        else:
            dirs.append(a)
    if not dirs:
        sys.exit(__doc__)
    outcome = {}
    for i, d in enumerate(dirs):
        if not os.path.isdir(d):
            sys.exit(f"mutants_table.py: {d} is not a folder")
        for kind in ("caught", "timeout", "missed", "unviable"):
            for m in read(d, kind + ".txt"):
                # A later stage can only catch what an earlier one missed; a mutant new to it
                # (cargo-mutants' unfiltered "delete field" ones) takes its outcome there.
                if i == 0 or m not in outcome or kind in ("caught", "timeout"):
                    outcome[m] = "caught" if kind == "timeout" else kind
    settled = {}
    if settled_file:
        if not os.path.isfile(settled_file):
            sys.exit(f"mutants_table.py: --settled {settled_file} is not a file")
        with open(settled_file) as f:
            for n, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip() or line.startswith("#"):
                    continue
                parts = line.split("\t")
                if len(parts) < 2 or parts[1] not in ("killed", "equivalent", "removed"):
                    sys.exit(f"{settled_file}:{n}: want NAME<TAB>killed|equivalent|removed<TAB>why")
                settled[parts[0]] = parts[1]
    unknown = [m for m in settled if m not in outcome]
    if unknown:
        sys.exit("mutants_table.py: settled but not in the runs: " + "; ".join(unknown[:3]))
    rows = collections.defaultdict(lambda: collections.Counter())
    for m, o in outcome.items():
        f = m.split(":", 1)[0]
        if o == "unviable":
            continue
        s = settled.get(m)
        if o == "missed" and s in ("equivalent", "removed"):
            continue
        rows[f]["viable"] += 1
        if o == "caught" or (o == "missed" and s == "killed"):
            rows[f]["caught"] += 1
        else:
            rows[f]["missed"] += 1
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
