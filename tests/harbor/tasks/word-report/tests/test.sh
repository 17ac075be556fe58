#!/bin/bash
# The report the solution wrote, read back and checked.
mkdir -p /logs/verifier
if python3 - <<'PY'
import json, sys
report = json.load(open("/app/report.json"))
want = {"total": 7, "counts": {"fork": 3, "sandbox": 2, "vm": 1, "agent": 1}}
print("report:", report)
sys.exit(0 if report == want else 1)
PY
then echo 1 >/logs/verifier/reward.txt; else echo 0 >/logs/verifier/reward.txt; fi
