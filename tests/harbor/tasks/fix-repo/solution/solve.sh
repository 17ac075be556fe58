#!/bin/bash
set -euo pipefail
cd /repo
sed -i 's/return a - b/return a + b/' calc.py
python3 -m unittest -q
git commit -qam "add adds"
