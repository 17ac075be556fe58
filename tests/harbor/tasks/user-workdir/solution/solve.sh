#!/bin/bash
set -euo pipefail
echo "$GREETING $(id -un) in $PWD" >note.txt
