#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import collections, getpass, json, os
words = open("words.txt").read().split()
report = {
    "total": len(words),
    "counts": collections.Counter(words),
    "by": getpass.getuser(),
    "label": os.environ["REPORT_LABEL"],
}
json.dump(report, open("report.json", "w"))
PY
