#!/bin/bash
# The tool on PATH here and in a login shell (whose /etc/profile resets PATH),
# and the output the solution wrote.
mkdir -p /logs/verifier
ok=1
[[ $(command -v sftool) == /opt/tool/bin/sftool ]] || { echo "sftool not on PATH: $PATH"; ok=0; }
[[ $(bash -lc 'command -v sftool') == /opt/tool/bin/sftool ]] || { echo "sftool not on a login shell's PATH"; ok=0; }
[[ $(cat /app/out.txt) == "sftool says solved" ]] || { echo "out.txt: $(cat /app/out.txt)"; ok=0; }
echo "$ok" >/logs/verifier/reward.txt
