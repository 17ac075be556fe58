#!/bin/bash
# The tests pass on the committed tree, and the fix is a commit of its own.
mkdir -p /logs/verifier
cd /repo || exit 1
ok=1
git diff --quiet HEAD || { echo "uncommitted changes"; ok=0; }
[[ $(git rev-list --count HEAD) == 2 ]] || { echo "commits: $(git log --oneline)"; ok=0; }
python3 -m unittest -q || ok=0
echo "$ok" >/logs/verifier/reward.txt
