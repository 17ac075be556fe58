#!/bin/bash
# The whole test suite (README, "Tests"): the runner in tests/runner owns it
# all; `scripts/test.sh --help` lists its flags. python3 first: scripts/deps.sh
# installs it on a machine without.
command -v python3 >/dev/null || "$(dirname "${BASH_SOURCE[0]}")/deps.sh" || exit
cd "$(dirname "${BASH_SOURCE[0]}")/.." && PYTHONPATH=tests/runner exec python3 -m sandfork_runner "$@"
