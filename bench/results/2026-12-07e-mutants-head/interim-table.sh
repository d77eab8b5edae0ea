#!/usr/bin/env bash
# The interim table of this run (issue 29, item 9), from the repository root:
#   bash bench/results/2026-12-07e-mutants-head/interim-table.sh > …/interim-table.md
# Its parts: carried shard-6 outcomes (filtered to the carried names) + stage 1's five parts
# + stage 2 (campaign kills as 'caught', passes as 'missed'), settled = this run's settled lines
# still missed after stage 2, plus the carried settlements.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=bench/results/2026-12-07e-mutants-head
export T=$(mktemp -d)
mkdir -p $T/shard6 $T/s2
for k in caught missed timeout unviable; do
  grep -xF -f $D/carried-from-shard6.txt bench/results/2026-12-07d-mutants-shard6/$k.txt > $T/shard6/$k.txt || true
done
python3 - <<'PY'
import os
D="bench/results/2026-12-07e-mutants-head"; T=os.environ["T"]
caught=[];missed=[]
for f in [D+"/stage2-campaigns/results.tsv", D+"/stage2-campaigns/zoo40/results.tsv"]:
    if not os.path.exists(f): continue
    for l in open(f):
        r=l.rstrip("\n").split("\t")
        if r[0].startswith("(") or len(r)<2: continue
        if r[1]=="killed": caught.append(r[0])
        elif r[1]=="passed": missed.append(r[0])
caught=sorted(set(caught)); missed=sorted(set(missed)-set(caught))
open(T+"/s2/caught.txt","w").write("\n".join(caught)+"\n")
open(T+"/s2/missed.txt","w").write("\n".join(missed)+"\n")
PY
python3 - <<'PY'
import os, sys
D="bench/results/2026-12-07e-mutants-head"; T=os.environ["T"]
s2c=set(open(T+"/s2/caught.txt").read().split("\n"))
carried=set(open(D+"/carried-from-shard6.txt").read().split("\n"))
sh6missed=set(open(T+"/shard6/missed.txt").read().split("\n"))
out=[]
for l in open(D+"/settled.txt"):
    n=l.split("\t")[0]
    if l.strip() and n not in s2c: out.append(l.rstrip("\n"))
names={l.split("\t")[0] for l in out}
for l in open("bench/results/2026-12-07d-mutants-shard6/settled-for-shard6.txt"):
    n=l.split("\t")[0]
    if l.strip() and not l.startswith("#") and n in carried and n in sh6missed and n not in names:
        out.append(l.rstrip("\n")); names.add(n)
open(T+"/settled.txt","w").write("\n".join(out)+"\n")
print(len(out), "settled lines", file=__import__("sys").stderr)
PY
P=$D/stage1-partial
python3 bench/mutants_table.py $T/shard6 $P $P"2" $P"3" $P"4" $P"5" $T/s2 --settled $T/settled.txt
rm -rf "$T"
