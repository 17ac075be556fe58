#!/bin/bash
# The report the solution wrote as the image's user in its workdir, read back.
mkdir -p /logs/verifier
if python3 - <<'PY'
import json, os, pwd, sys
path = "/home/worker/project/report.json"
report = json.load(open(path))
want = {
    "total": 7,
    "counts": {"fork": 3, "sandbox": 2, "vm": 1, "agent": 1},
    "by": "worker",
    "label": "words of /home/worker/project",
}
owner = pwd.getpwuid(os.stat(path).st_uid).pw_name
print("report:", report, "owner:", owner)
sys.exit(0 if report == want and owner == "worker" else 1)
PY
then echo 1 >/logs/verifier/reward.txt; else echo 0 >/logs/verifier/reward.txt; fi
