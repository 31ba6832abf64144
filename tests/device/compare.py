"""Compares what gputrace decoded from the real driver with what allocate.py asked for."""
import json
import sys

out = sys.argv[1]
asked = json.load(open(f"{out}/expected.json"))
records = [json.loads(line) for line in open(f"{out}/real.trace")][1:]
allocs = [r for r in records if r["ev"] == "alloc"]
print(f"{len(records)} records, {len(allocs)} allocations, "
      f"{sum(r['ev'] == 'undecodable' for r in records)} undecodable, {sum(r['ev'] == 'free' for r in records)} frees")
for r in allocs:
    print(f"  {r['via']:<28} {r['memory']:<8} {r['bytes']:>16} status {r['status']:#x} class {r.get('class', 0):#x}")
for r in records:
    if r["ev"] == "undecodable":
        print("  UNDECODABLE", r)
problems = 0
for a in asked:
    if a["api"] == "cudaMallocManaged":
        continue  # managed pages come by fault, through no ioctl: not expected in the trace
    want_failure = a["api"].endswith("expected-failure")
    kind = "system" if a["api"] == "cudaHostAlloc" else "video"
    # The driver rounds sizes up (2 MiB pages for video memory).
    match = [r for r in allocs if r["memory"] == kind and a["bytes"] <= r["bytes"] <= a["bytes"] + (2 << 20)
             and (r["status"] != 0) == want_failure]
    print(f"{a['api']:<28} {a['bytes']:>16}: {'found' if match else 'MISSING'}")
    problems += not match
sys.exit(1 if problems else 0)
