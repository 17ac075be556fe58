#!/bin/bash
# shellcheck disable=SC2016  # commands for the sandbox's shell are single-quoted
# The unmodified E2B CLI (@e2b/cli, pinned in tests/e2b-cli, installed into a
# cache as the SDKs are: scripts/sdk-setup.sh) against a real node,
# configured by environment variables only (E2B_API_KEY, E2B_API_URL,
# E2B_SANDBOX_URL): sandbox create, list, info, exec, connect (an interactive
# shell, driven through tmux), logs, metrics, pause, resume, snapshot
# create/list/delete, kill and kill --all; template create from a Dockerfile
# (FROM e2bdev/base with ENV, WORKDIR and RUN), list, unpublish and delete.
# Each step asserts on the CLI's real output.
#
# Usage: scripts/e2b-cli-test.sh [--no-build] [--server URL]
#   --no-build    do not run scripts/build.sh (target/sandfork.env must exist)
#   --server URL  test a node that is already running at URL (its key in
#                 E2B_API_KEY) instead of starting one (scripts/sdk-test.sh
#                 runs it so, on its node)
# Env: SANDFORK_CACHE (the CLI's cache, as scripts/sdk-setup.sh), SANDFORK_LAB_LOCKED.
# Out: the node's log in target/e2b-cli-test/serve.log (when it starts one).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

log() { echo "e2b-cli-test: $*" >&2; }
die() { log "error: $*"; exit 1; }

build=1 server=''
while (($#)); do
    case $1 in
        --no-build) build=0; shift ;;
        --server) server=${2:?--server needs a URL}; shift 2 ;;
        -h | --help) sed -n '3,/^set -e/p' "${BASH_SOURCE[0]}" | sed -n 's/^# \{0,1\}//p'; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
command -v tmux >/dev/null || die "tmux is missing: run scripts/deps.sh"

. scripts/sdk-setup.sh
. scripts/node.sh

work=$(mktemp -d)
tmux_socket=e2b-cli-test-$$
cleanup() {
    tmux -L "$tmux_socket" kill-server 2>/dev/null || true
    stop_node
    rm -rf "$work"
}
trap cleanup EXIT

if [[ -z $server ]]; then
    ((build)) && scripts/build.sh
    [[ -f target/sandfork.env ]] || die "target/sandfork.env missing (run scripts/build.sh)"
    set -a
    # shellcheck source=/dev/null  # written by scripts/build.sh
    . target/sandfork.env
    set +a
fi
setup_node
setup_e2b_cli
if [[ -n $server ]]; then
    [[ -n ${E2B_API_KEY:-} ]] || die "--server needs E2B_API_KEY"
    node_url=$server node_key=$E2B_API_KEY
else
    start_node target/debug/sandfork target/e2b-cli-test
fi

# The CLI's whole configuration: no ~/.e2b (a fresh HOME), no update check
# (it would ask the registry), no colours on plain output.
mkdir -p "$work/home"
export HOME=$work/home NO_UPDATE_NOTIFIER=1 FORCE_COLOR=0
export E2B_API_URL=$node_url E2B_SANDBOX_URL=$node_url E2B_API_KEY=$node_key
unset E2B_DOMAIN E2B_ACCESS_TOKEN

# `e2b ARGS...`: stdin is not a pipe unless the caller makes it one (the
# CLI streams a piped stdin to `exec`).
e2b() { "$node" "$e2b_cli" "$@"; }
plain() { sed 's/\x1b\[[0-9;]*m//g'; }

step_started=$SECONDS
step() {
    log "== $* (previous step: $((SECONDS - step_started)) s)"
    step_started=$SECONDS
}
fail() {
    log "FAILED: $*"
    exit 1
}
# expect TEXT OUTPUT: OUTPUT contains TEXT
expect() { [[ $2 == *"$1"* ]] || fail "expected \"$1\" in:"$'\n'"$2"; }
reject() { [[ $2 != *"$1"* ]] || fail "did not expect \"$1\" in:"$'\n'"$2"; }
# json PYTHON-EXPRESSION: evaluates it with `d` the JSON document on stdin
json() { python3 -c "import json, sys; d = json.load(sys.stdin); print($1)"; }

step "version"
out=$(e2b --version </dev/null)
expect "2.19.0" "$out"

step "sandbox create --detach"
out=$(e2b sandbox create base --detach --timeout 600 </dev/null)
id=$(tail -n1 <<<"$out")
[[ $id =~ ^[a-z0-9]{20}$ ]] || fail "no sandbox id from create: $out"

step "sandbox list, as a table and as JSON"
out=$(e2b sandbox list </dev/null | plain)
expect "$id" "$out"
expect "Running" "$out"
out=$(e2b sandbox list --format json </dev/null)
[[ $(json "[s['state'] + ' ' + s['templateId'] for s in d if s['sandboxId'] == '$id']" <<<"$out") == "['running base']" ]] ||
    fail "sandbox list --format json: $out"

step "sandbox info"
out=$(e2b sandbox info "$id" --format json </dev/null)
[[ $(json "d['sandboxId'], d['state']" <<<"$out") == "$id running" ]] || fail "sandbox info: $out"
out=$(e2b sandbox info "$id" </dev/null | plain)
expect "Sandbox info for $id" "$out"
expect "State: running" "$out"

step "sandbox exec: output, exit code, options, piped stdin"
status=0
out=$(e2b sandbox exec "$id" -- sh -c 'echo out-$((6*7)); echo err >&2; exit 3' </dev/null 2>"$work/err") || status=$?
# (the CLI adds "exit status 3" to stderr)
[[ $status == 3 && $out == out-42 && $(head -n1 "$work/err") == err ]] ||
    fail "exec: status $status, stdout $out, stderr $(cat "$work/err")"
out=$(e2b sandbox exec -u root -c /tmp -e GREET=hi "$id" sh -c 'echo $(id -un) $(pwd) $GREET' </dev/null)
[[ $out == "root /tmp hi" ]] || fail "exec with options: $out"
out=$(printf 'line one\nline two\n' | e2b sandbox exec "$id" wc -l)
[[ $out == 2 ]] || fail "exec with piped stdin: $out"

step "sandbox connect: an interactive shell through tmux"
cat >"$work/connect.sh" <<EOF
export HOME='$HOME' NO_UPDATE_NOTIFIER=1 E2B_API_URL='$E2B_API_URL' E2B_SANDBOX_URL='$E2B_SANDBOX_URL' E2B_API_KEY='$E2B_API_KEY'
'$node' '$e2b_cli' sandbox connect $id
echo \$? > '$work/connect.exit'
sleep 30
EOF
tmux -L "$tmux_socket" new-session -d -s t -x 100 -y 30 sh "$work/connect.sh"
screen() { tmux -L "$tmux_socket" capture-pane -p -t t; }
wait_screen() {
    local deadline=$((SECONDS + $2))
    until screen | grep -qF -- "$1"; do
        ((SECONDS < deadline)) || fail "no \"$1\" on the terminal:"$'\n'"$(screen)"
        sleep 0.2
    done
}
keys() { tmux -L "$tmux_socket" send-keys -t t -l "$1" && tmux -L "$tmux_socket" send-keys -t t Enter; }
wait_screen "Terminal connecting to sandbox $id" 60
keys 'echo MARK$((40+2)) | tee /tmp/connected; stty size'
wait_screen "MARK42" 60
# the pane's size (rows, columns: the window less tmux's status line)
# reached the sandbox's terminal
wait_screen "$(tmux -L "$tmux_socket" display-message -p -t t '#{pane_height} #{pane_width}')" 30
keys 'exit'
deadline=$((SECONDS + 60))
until [[ -s $work/connect.exit ]]; do
    ((SECONDS < deadline)) || fail "sandbox connect did not end after exit:"$'\n'"$(screen)"
    sleep 0.2
done
[[ $(cat "$work/connect.exit") == 0 ]] || fail "sandbox connect exited $(cat "$work/connect.exit"):"$'\n'"$(screen)"
wait_screen "Closing terminal connection to sandbox $id" 10
tmux -L "$tmux_socket" kill-server
out=$(e2b sandbox exec "$id" cat /tmp/connected </dev/null)
[[ $out == MARK42 ]] || fail "what the shell wrote: $out"

step "sandbox logs"
out=$(e2b sandbox logs "$id" </dev/null | plain)
expect "Logs for sandbox $id" "$out"
# the agent's log of the create's /init and of the commands above
expect "logger: 'agent'" "$out"
expect "/init applied" "$out"
out=$(e2b sandbox logs "$id" --format json --loggers agent </dev/null)
# one JSON object a line (after a blank one)
[[ $(python3 -c '
import json, sys
lines = [json.loads(l) for l in sys.stdin if l.strip()]
print(bool(lines) and all(l["logger"] == "agent" and l["message"] for l in lines))' <<<"$out") == True ]] ||
    fail "sandbox logs --loggers agent: $out"
out=$(e2b sandbox logs "$id" --level ERROR </dev/null | plain)
reject "/init applied" "$out"

step "sandbox metrics"
# One JSON object a line (after a blank one, as logs); the node samples
# every few seconds, so the first may take a moment.
for _ in $(seq 15); do
    out=$(e2b sandbox metrics "$id" --format json </dev/null)
    grep -q -v '^[[:space:]]*$' <<<"$out" && break
    sleep 2
done
[[ $(grep -m1 -v '^[[:space:]]*$' <<<"$out" | json "d['cpuCount'] >= 1 and d['memTotal'] > 0 and d['diskTotal'] > 0") == True ]] ||
    fail "sandbox metrics --format json: $out"
out=$(e2b sandbox metrics "$id" </dev/null | plain)
expect "Metrics for sandbox $id" "$out"
expect "CPU:" "$out"
expect "MiB" "$out"

step "sandbox pause and resume"
out=$(e2b sandbox pause "$id" </dev/null | plain)
expect "Sandbox $id has been paused" "$out"
out=$(e2b sandbox list --state paused --format json </dev/null)
[[ $(json "[s['sandboxId'] for s in d]" <<<"$out") == *"'$id'"* ]] || fail "not listed as paused: $out"
out=$(e2b sandbox list --format json </dev/null)
[[ $(json "[s['sandboxId'] for s in d]" <<<"$out") != *"'$id'"* ]] || fail "a paused sandbox listed as running: $out"
# its logs and metrics are still there while it is paused
out=$(e2b sandbox logs "$id" </dev/null | plain)
expect "/init applied" "$out"
out=$(e2b sandbox resume "$id" </dev/null | plain)
expect "Sandbox $id has been resumed" "$out"
out=$(e2b sandbox exec "$id" cat /tmp/connected </dev/null)
[[ $out == MARK42 ]] || fail "after the resume: $out"

step "sandbox snapshot create, list, delete"
out=$(e2b sandbox snapshot create "$id" </dev/null | plain)
expect "from sandbox $id" "$out"
snap=$(sed -n 's/^Created snapshot \([^ ]*\) from sandbox.*/\1/p' <<<"$out")
[[ -n $snap ]] || fail "no snapshot id: $out"
out=$(e2b sandbox snapshot list "$id" --format json </dev/null)
[[ $(json "[s['snapshotId'] for s in d]" <<<"$out") == "['$snap']" ]] || fail "snapshot list: $out"
out=$(e2b sandbox snapshot delete "$snap" </dev/null | plain)
expect "Snapshot $snap has been deleted" "$out"

step "sandbox kill"
out=$(e2b sandbox kill "$id" </dev/null 2>&1 | plain)
expect "Sandbox $id has been killed" "$out"
out=$(e2b sandbox kill "$id" </dev/null 2>&1 | plain)
expect "Sandbox $id wasn't found" "$out"
out=$(e2b sandbox info "$id" </dev/null 2>&1 | plain) && fail "info of a killed sandbox: $out"
expect "wasn't found" "$out"

step "template create from a Dockerfile (FROM e2bdev/base, ENV, WORKDIR, RUN)"
mkdir -p "$work/tpl"
cat >"$work/tpl/e2b.Dockerfile" <<'EOF'
FROM e2bdev/base
ENV GREETING=from-the-cli
WORKDIR /opt/app
RUN echo "$GREETING" > built.txt && mkdir -p sub
RUN ls -d /opt/app/sub > dirs.txt
EOF
tpl=cli-tpl-$$
out=$(e2b template create "$tpl" --path "$work/tpl" </dev/null 2>&1 | plain) ||
    fail "template create:"$'\n'"$out"
expect "e2b.Dockerfile that will be used to build the sandbox template" "$out"
expect "Building sandbox template $tpl finished" "$out"
out=$(e2b sandbox create "$tpl" --detach --timeout 600 </dev/null)
from_tpl=$(tail -n1 <<<"$out")
out=$(e2b sandbox exec "$from_tpl" sh -c 'cat built.txt dirs.txt; echo $GREETING $(pwd) $(id -un)' </dev/null)
[[ $out == $'from-the-cli\n/opt/app/sub\nfrom-the-cli /opt/app user' ]] || fail "a sandbox of the template: $out"

step "template list"
out=$(e2b template list </dev/null | plain)
expect "$tpl" "$out"
out=$(e2b template list --format json </dev/null)
[[ $(json "[t['cpuCount'] >= 1 for t in d if '$tpl' in t['aliases']]" <<<"$out") == "[True]" ]] ||
    fail "template list --format json: $out"

step "template unpublish"
out=$(e2b template unpublish "$tpl" --yes </dev/null 2>&1 | plain) || fail "template unpublish: $out"
expect "$tpl" "$out"

step "sandbox kill --all"
second=$(e2b sandbox create base --detach --timeout 600 </dev/null | tail -n1)
out=$(e2b sandbox kill --all </dev/null | plain)
expect "Sandbox $from_tpl has been killed" "$out"
expect "Sandbox $second has been killed" "$out"
[[ $out =~ Killed\ [0-9]+\ running\ sandboxes ]] || fail "kill --all: $out"
out=$(e2b sandbox list --format json </dev/null)
[[ $(json "len(d)" <<<"$out") == 0 ]] || fail "running after kill --all: $out"
out=$(e2b sandbox kill --all </dev/null | plain)
expect "No running sandboxes" "$out"

step "template delete"
out=$(e2b template delete "$tpl" --yes </dev/null 2>&1 | plain) || fail "template delete: $out"
expect "Deleting sandbox template" "$out"
out=$(e2b template list --format json </dev/null)
[[ $(json "[t['templateID'] for t in d if '$tpl' in t['aliases']]" <<<"$out") == "[]" ]] ||
    fail "still listed after delete: $out"

step "done"
log "the E2B CLI passed"
