#!/bin/bash
set -euo pipefail
# by name: the image's ENV put it on PATH
sftool solved >/app/out.txt
