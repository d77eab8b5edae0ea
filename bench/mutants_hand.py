#!/usr/bin/env python3
"""Applies one cargo-mutants mutant to the source by hand, runs a command, restores the source.

    ROOT=TREE bench/mutants_hand.py NAME -- CMD...

NAME is a mutant as `cargo mutants --list` names it (`FILE:LINE:COL: replace A with B in F`,
`FILE:LINE:COL: delete X in F`, or a function's body replaced:
`FILE:LINE:COL: replace F -> T with VALUE`). ROOT (default: the current folder) is the tree it is
applied in, and CMD runs there. An operator is replaced at its line and column (the text there
must be the operator, else nothing runs); a function's body gets `return VALUE;` (or `return;`
for `()`) at the column cargo-mutants names, its first statement. Prints `KILLED NAME` when CMD
fails (with the first failing tests), `SURVIVED NAME` when it passes. The source is restored
whatever happens. Used to settle stage-1 survivors against tests cargo-mutants' run did not
have, or against a subset of the simulator's tests (bench/mutants.sh's stage 2 runs them all).

Not handled: "delete match arm" mutants (deleted by hand) and cargo-mutants' "delete field"
ones; a body replaced in a function returning `impl Trait` is applied but does not build (the
early return's type is not the body's): replace that body by hand. A mutant it cannot apply exits 2 and names why.
"""
import os
import re
import subprocess
import sys


def fail(msg):
    print(f"mutants_hand.py: {msg}", file=sys.stderr)
    sys.exit(2)


if "--" not in sys.argv or sys.argv.index("--") != 2 or len(sys.argv) < 4:
    fail("usage: ROOT=TREE bench/mutants_hand.py NAME -- CMD...")
name = sys.argv[1]
cmd = sys.argv[3:]
try:
    f, l, c, desc = name.split(":", 3)
    l, c = int(l), int(c)
except ValueError:
    fail(f"not a mutant name (FILE:LINE:COL: ...): {name!r}")
root = os.environ.get("ROOT", ".")
path = os.path.join(root, f)
try:
    with open(path, encoding="utf-8") as fh:
        orig = fh.read()
except (OSError, UnicodeDecodeError) as e:
    fail(f"cannot read {path}: {e}")
lines = orig.split("\n")
if not 1 <= l <= len(lines):
    fail(f"{f} has no line {l}")
line = lines[l - 1]
at = c - 1
m = re.match(r"\s*replace (.+?) with (.+?)(?: in .*)?$", desc)
d = re.match(r"\s*delete (\S+) in ", desc)
if "match arm" in desc or "delete field" in desc:
    fail(f"cannot apply {desc.strip()!r}: delete the arm or field by hand")
guard = False
if d:
    old, new = d.group(1), ""
elif m:
    old, new = m.group(1), m.group(2)
    guard = old.startswith("match guard ")
    if guard:
        old = old[len("match guard "):]
else:
    fail(f"cannot apply: {desc!r}")
# A function's body replaced: cargo-mutants names the function (an operator never starts with
# a letter; a match guard's expression does, and is replaced where it stands).
body = m and not d and not guard and re.match(r"^[A-Za-z_<]", old)
if body:
    ret = "return;" if new == "()" else f"return {new};"
    lines[l - 1] = line[:at] + "#[allow(unreachable_code)] { " + ret + " } " + line[at:]
elif not line[at:].startswith(old):
    fail(f"at {f}:{l}:{c} expected {old!r}, the line is {line!r}")
else:
    lines[l - 1] = line[:at] + new + line[at + len(old):]
with open(path, "w", encoding="utf-8") as fh:
    fh.write("\n".join(lines))
try:
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    out = r.stdout + r.stderr
    print(("KILLED" if r.returncode else "SURVIVED") + " " + name)
    fails = [
        x
        for x in out.split("\n")
        if x.startswith("---- ") or (x.strip().startswith("test ") and x.endswith("FAILED"))
    ]
    for x in fails[:4]:
        print("   ", x)
    if r.returncode and "error[" in out[-1500:]:
        print("  (build error?)", out[-600:])
    sys.stdout.flush()
finally:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(orig)
