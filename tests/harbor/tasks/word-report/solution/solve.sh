#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import collections, json
words = open("/app/words.txt").read().split()
json.dump({"total": len(words), "counts": collections.Counter(words)}, open("/app/report.json", "w"))
PY
