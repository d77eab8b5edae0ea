#!/usr/bin/env python3
"""Carries settled mutants (killed by a later test, or equivalent) to the names of a later commit.

    bench/mutants_carry.py HEAD_LIST [COMMIT:SETTLED_FILE[:RUN_DIR] ...]

HEAD_LIST is `cargo mutants --list` at the commit the table is for (its names, one a line).
Each SETTLED_FILE holds `NAME<TAB>killed|equivalent|removed<TAB>why` lines, its names as a run
at COMMIT listed them. A line is carried when its name is in HEAD_LIST and the mutated file is
the same, byte for byte, at COMMIT and at HEAD (`git diff --quiet COMMIT HEAD -- FILE`): the
name then means the same change to the same text. With RUN_DIR, COMMIT applies only to the names
that run's lists (caught, missed, timeout, unviable .txt) hold, so one settled file that names
mutants of several runs is given once per run.

Prints the carried lines (a `--settled` file for bench/mutants_table.py), and on stderr, per
file, how many were carried and why the others were not. A name two inputs carry is printed
once, the first input's line kept.
"""
import os
import subprocess
import sys


def fail(msg):
    sys.exit(f"mutants_carry.py: {msg}")


def read_lines(path):
    try:
        with open(path, encoding="utf-8") as f:
            return [l.rstrip("\n") for l in f if l.strip()]
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read {path}: {e}")


def run_names(d):
    inner = os.path.join(d, "mutants.out")
    d = inner if os.path.isdir(inner) else d
    names = set()
    for k in ("caught", "missed", "timeout", "unviable"):
        p = os.path.join(d, k + ".txt")
        if os.path.exists(p):
            names.update(read_lines(p))
    if not names:
        fail(f"{d} holds no mutant lists")
    return names


same_cache = {}


def same_file(commit, path):
    key = (commit, path)
    if key not in same_cache:
        r = subprocess.run(["git", "diff", "--quiet", commit, "HEAD", "--", path])
        if r.returncode not in (0, 1):
            fail(f"git diff {commit} HEAD -- {path} failed")
        same_cache[key] = r.returncode == 0
    return same_cache[key]


def main(argv):
    if len(argv) < 2:
        fail(__doc__.strip().splitlines()[2].strip())
    head = set(read_lines(argv[1]))
    seen = set()
    for spec in argv[2:]:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            fail(f"{spec}: give COMMIT:SETTLED_FILE[:RUN_DIR]")
        commit, settled = parts[0], parts[1]
        only = run_names(parts[2]) if len(parts) == 3 else None
        counts = {"carried": 0, "not this run's": 0, "not at HEAD": 0, "file changed": 0}
        for line in read_lines(settled):
            fields = line.split("\t")
            if len(fields) < 3 or fields[1] not in ("killed", "equivalent", "removed"):
                fail(f"{settled}: not NAME<TAB>killed|equivalent|removed<TAB>why: {line!r}")
            name = fields[0]
            if only is not None and name not in only:
                counts["not this run's"] += 1
            elif name not in head:
                counts["not at HEAD"] += 1
            elif not same_file(commit, name.split(":", 1)[0]):
                counts["file changed"] += 1
            else:
                counts["carried"] += 1
                if name not in seen:
                    seen.add(name)
                    print(line)
        print(f"{spec}: " + ", ".join(f"{v} {k}" for k, v in counts.items()), file=sys.stderr)


main(sys.argv)
