#!/bin/bash
# Three sandfork nodes behind two gateways, with three real etcd members, all
# on loopback inside the KVM lab (one lab machine; the nodes' sandboxes are
# real microVMs, run with --no-network since nodes on one host would take
# the same network slot names and ranges). Through the gateway: create, run
# a command, list, kill; and the nodes registered; a named snapshot made on
# one node created from by name on another (taken in from the object
# store), creates from it then placed on the nodes that have it, deleted
# everywhere; the Python SDK's create and lifecycle tests and some of its
# command and file tests (control plane through one gateway, envd through
# the other). etcd loses its leader during a burst of creates (none lost or
# doubled), then its quorum (running sandboxes answer, creates answer 503,
# and work once it is back). A fork of 8 on the third node (room for 2
# children) makes 2 there and 6 on the others, which fetch the frozen
# fork's files from it; each child diverges, the parent is unaffected. A
# team's sandbox limit holds across both gateways and nodes (made through
# one, its key through the other; creates racing through both). Then, with an S3
# server (SeaweedFS's weed, from scripts/deps.sh) as the object store: a
# sandbox paused on its node, that node killed with SIGKILL and its data
# dir removed, resumed through the gateway on the other node with its files
# and a running process intact (and one paused at its timeout, stored by
# its node's reconciler, resumed there too). Last, that node comes back in a network
# namespace of its own, pauses a sandbox, and its only link goes down: the
# sandbox is resumed on the other node meanwhile, and once the link is up
# again the cut-off node's stale copy never serves and is removed. With the
# object store down, a pause stays on its node, and is stored once it is back.
#
# Usage: scripts/cluster-test.sh [--no-build]
# Env: CARGO_TARGET_DIR (default target), SANDFORK_LAB_LOCKED (the caller
#      holds the lab lock), SANDFORK_CLUSTER_SDK=all (the SDK's command and
#      file tests whole, not the ones that stream through the proxy).
# Out: logs in $target/cluster-test/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
log() { echo "cluster-test: $*" >&2; }
die() { log "FAIL: $*"; exit 1; }
target=${CARGO_TARGET_DIR:-$root/target}
rw=/var/cache/sandfork/lab-rw

if [[ ${1:-} != --inside ]]; then
    # Every binary used here comes from scripts/build.sh (the caller's,
    # under --no-build).
    if [[ ${1:-} != --no-build ]]; then
        scripts/build.sh
    fi
    set -a
    # shellcheck source=/dev/null  # written by scripts/build.sh
    . target/sandfork.env
    set +a
    mkdir -p "$rw"
    # The unmodified Python SDK (its cache is outside the lab's reach to write).
    sdk_python=$(scripts/sdk-setup.sh)
    lab=("$target/debug/sandfork-lab" run --cpus 1 --timeout 2400 --rw "$rw" --
        env "CARGO_TARGET_DIR=$target" "SANDFORK_KERNEL=$SANDFORK_KERNEL" "SDK_PYTHON=$sdk_python"
        "SANDFORK_ROOTFS=$SANDFORK_ROOTFS" "SANDFORK_CLUSTER_SDK=${SANDFORK_CLUSTER_SDK:-}"
        "SANDFORK_VMM=${SANDFORK_VMM:-$target/debug/sandfork-vmm}" bash "$root/scripts/cluster-test.sh" --inside)
    if [[ -z ${SANDFORK_LAB_LOCKED:-} ]]; then
        lab=(flock /tmp/sandfork-lab.lock "${lab[@]}")
    fi
    exec "${lab[@]}"
fi

# Inside the lab: /work is read-only, $rw is writable. (`ip` is in sbin.)
export PATH=$PATH:/usr/sbin:/sbin
work=$(mktemp -d "$rw/cluster-test.XXXXXX")
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    ip netns del "$cut_ns" 2>/dev/null || true
    rm -rf "$work/n1" "$work/n2" "$work/n3" "$work/etcd" "$work/weed"
}
trap cleanup EXIT
bin=$target/debug/sandfork
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# The network namespace the partition test's node runs in: one veth pair to
# this namespace (etcd and the S3 server listen on its address too).
cut_ns=sfcut$$ cut_link=sfcut$$h cut_host=10.213.0.1 cut_node=10.213.0.2
ip netns add "$cut_ns"
ip link add "$cut_link" type veth peer name sfcutn netns "$cut_ns"
ip addr add "$cut_host/30" dev "$cut_link"
ip link set "$cut_link" up
in_cut_ns() { nsenter --net="/run/netns/$cut_ns" "$@"; }
in_cut_ns ip addr add "$cut_node/30" dev sfcutn
in_cut_ns ip link set sfcutn up
in_cut_ns ip link set lo up
# Three etcd members (a quorum of two), each also on the address the cut-off
# node reaches. Raft's timings are five times etcd's defaults: the lab's one
# emulated CPU is busy with guests. The zap logger: with 3.4's default
# (capnslog) a slow read's retry warning dereferences a nil logger and the
# member dies (etcd-io/etcd#14402; seen in a CI run, Debian's 3.4.23).
etcd_ports=() etcd_peers=() initial=()
declare -A etcd_pid=()
for m in 1 2 3; do
    etcd_ports+=("$(free_port)")
    etcd_peers+=("$(free_port)")
    initial+=("e$m=http://127.0.0.1:${etcd_peers[m - 1]}")
done
start_etcd() { # MEMBER (1-3), on its ports and data dir
    local m=$1 client=${etcd_ports[$1 - 1]} peer=${etcd_peers[$1 - 1]}
    etcd --name="e$m" --data-dir="$work/etcd/e$m" \
        --listen-client-urls="http://127.0.0.1:$client,http://$cut_host:$client" \
        --advertise-client-urls="http://127.0.0.1:$client" \
        --listen-peer-urls="http://127.0.0.1:$peer" --initial-advertise-peer-urls="http://127.0.0.1:$peer" \
        --initial-cluster="$(IFS=,; echo "${initial[*]}")" --initial-cluster-state=new \
        --heartbeat-interval=500 --election-timeout=5000 \
        --logger=zap --log-outputs=stderr >>"$work/etcd$m.log" 2>&1 &
    pids+=($!)
    etcd_pid[$m]=$!
}
for m in 1 2 3; do start_etcd "$m"; done
endpoints() { # HOST: the members' client URLs on HOST, comma-separated
    local urls=()
    for port in "${etcd_ports[@]}"; do urls+=("http://$1:$port"); done
    (IFS=,; echo "${urls[*]}")
}
SANDFORK_ETCD=$(endpoints 127.0.0.1)
export SANDFORK_ETCD
start=$SECONDS
until ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" --command-timeout=5s endpoint health >/dev/null 2>&1; do
    ((SECONDS - start < 120)) || { tail -n 20 "$work"/etcd*.log >&2; die "etcd's three members have no quorum"; }
    sleep 1
done
# The member that leads now (1-3; none: empty). A member that is down is
# left out of etcdctl's answer (which then fails).
etcd_leader() {
    { ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" endpoint status -w json 2>/dev/null || true; } |
        python3 -c 'import json, sys
endpoints = sys.argv[1].split(",")
for m in json.loads(sys.stdin.read() or "[]"):
    if m["Status"]["header"]["member_id"] == m["Status"]["leader"]:
        print(endpoints.index(m["Endpoint"]) + 1)' "$SANDFORK_ETCD"
}
# The object store, up before the nodes (each makes sure of its bucket).
# Every gRPC port is given: weed's default (port + 10000) may not exist.
# Room for 4 GiB (64 volumes of 64 MiB): every node stores its templates,
# the lifecycle tests their pauses and snapshots (1 GiB ran out).
s3_port=$(free_port)
weed_args=(server -dir="$work/weed" -ip=127.0.0.1 -ip.bind=0.0.0.0 -s3
    -master.volumeSizeLimitMB=64 -volume.max=64)
for service in master volume filer s3; do
    port=$(free_port)
    [[ $service == s3 ]] && port=$s3_port
    weed_args+=("-$service.port=$port" "-$service.port.grpc=$(free_port)")
done
mkdir -p "$work/weed"
weed "${weed_args[@]}" >"$work/weed.log" 2>&1 &
pids+=($!)
weed_pid=$!
start=$SECONDS
until [[ $(curl -s -o /dev/null -w '%{http_code}' -X PUT "http://127.0.0.1:$s3_port/sandfork") =~ ^(200|409)$ ]]; do
    ((SECONDS - start < 120)) || { tail -n 30 "$work/weed.log" >&2; die "the S3 server did not start"; }
    sleep 0.5
done
log "S3 server up in $((SECONDS - start)) s"
export SANDFORK_S3=http://127.0.0.1:$s3_port/sandfork
export SANDFORK_API_KEY=sandfork_cluster_test_$RANDOM$RANDOM
ports=()
declare -A node_pid=()
# n3 has room for 3 sandboxes (the fork across nodes below needs a node
# with room for a parent and 2 children).
for n in 1 2 3; do
    port=$(free_port)
    ports+=("$port")
    room=()
    [[ $n == 3 ]] && room=(--max-sandboxes 3)
    "$bin" serve --in-lab --role node --node-id "n$n" --listen "127.0.0.1:$port" \
        --data-dir "$work/n$n" --no-network --pool-size 1 --lease-ttl-secs 3 "${room[@]}" >"$work/n$n.log" 2>&1 &
    pids+=($!)
    node_pid[n$n]=$!
done
n3_api=http://127.0.0.1:${ports[2]}
gw=$(free_port) gw2=$(free_port)
"$bin" serve --role gateway --listen "127.0.0.1:$gw" >"$work/gw.log" 2>&1 &
pids+=($!)
"$bin" serve --role gateway --listen "127.0.0.1:$gw2" >"$work/gw2.log" 2>&1 &
pids+=($!)
export SANDFORK_API_URL=http://127.0.0.1:$gw

start=$SECONDS
for port in "${ports[@]}" "$gw" "$gw2"; do
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
        ((SECONDS - start < 800)) || { tail -n 30 "$work"/*.log >&2; die "no /health on $port"; }
        sleep 1
    done
done
log "etcd, 3 nodes and 2 gateways up in $((SECONDS - start)) s"
registered=$(ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" get --prefix --keys-only /sandfork/v1/nodes/ | grep -c . || true)
[[ $registered == 3 ]] || die "nodes registered: $registered, expected 3"

# Two creates: placement by free capacity puts them on different nodes.
# (the gateway counts what it placed until the node's published load shows it)
# They live through the timings, the snapshot and its forks below: on a
# busy lab that took longer than the default 300 s once (a's kill found it
# gone).
a=$("$bin" create --timeout 900) || die "create through the gateway"
b=$("$bin" create --timeout 900) || die "second create through the gateway"
log "created $a and $b"
route_of() { ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" get --print-value-only "/sandfork/v1/sandboxes/$1"; }
owner() { route_of "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["node_id"])'; }
# (not `| grep -q`: under pipefail its early exit fails etcdctl and the loop)
registered() { [[ -n $(ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" get --keys-only "/sandfork/v1/nodes/$1") ]]; }
# Waits until sandbox ID's route records a stored pause (at most 180 s); dies
# with WHY otherwise.
until_stored() { # ID WHY
    local start=$SECONDS
    until [[ $(route_of "$1") == *'"paused"'* ]]; do
        ((SECONDS - start < 180)) || die "$2"
        sleep 1
    done
}
oa=$(owner "$a") ob=$(owner "$b")
log "$a on $oa, $b on $ob"
[[ $oa != "$ob" ]] || die "both sandboxes on $oa"
for id in "$a" "$b"; do
    out=$("$bin" exec "$id" -- echo "hello from $id") || die "exec in $id"
    [[ $out == "hello from $id" ]] || die "exec in $id printed '$out'"
done
# What the gateway adds to a command: the median of 15 through it and 15
# straight to the node (each a whole `sandfork exec`).
exec_ms() {
    python3 - "$bin" "$1" "$2" <<'PY'
import os, statistics, subprocess, sys, time
binary, sandbox, url = sys.argv[1:]
env = dict(os.environ, SANDFORK_API_URL=url)
took = []
for _ in range(15):
    t = time.monotonic()
    subprocess.run([binary, "exec", sandbox, "--", "true"], env=env, check=True, stdout=subprocess.DEVNULL)
    took.append((time.monotonic() - t) * 1000)
print(f"{statistics.median(took):.1f}")
PY
}
via_gateway_ms=$(exec_ms "$a" "$SANDFORK_API_URL") || die "timing commands through the gateway"
direct_ms=$(exec_ms "$a" "http://127.0.0.1:${ports[${oa#n} - 1]}") || die "timing commands on $oa"
log "a command in $a: ${via_gateway_ms} ms through the gateway, ${direct_ms} ms straight to $oa (medians of 15)"
listed=$("$bin" ls)
grep -q "$a" <<<"$listed" || die "ls through the gateway lacks $a: $listed"
grep -q "$b" <<<"$listed" || die "ls through the gateway lacks $b: $listed"
# A snapshot is stored in the object store by its sandbox's node: the
# gateway finds it for every request naming it (on its node, or on a node
# that takes it in), and a create from its name straight to another node
# takes it in from the store (found by the name) and sees a file written
# before the snapshot.
api() { curl -s -H "X-API-Key: $SANDFORK_API_KEY" -H 'Content-Type: application/json' "$@"; }
now_ms() { echo $((${EPOCHREALTIME/./} / 1000)); }
"$bin" exec "$b" -- sh -c 'cd && echo snapped > snap.txt' || die "writing in $b"
snap_name=warm-$RANDOM
snap=$("$bin" snapshot "$b" --name "$snap_name") || die "snapshot of $b through the gateway"
api "$SANDFORK_API_URL/snapshots" | python3 -c 'import json, sys
ids = [s["snapshotID"] for s in json.load(sys.stdin)]
sys.exit(ids.count(sys.argv[1]) != 1)' "$snap" || die "the gateway's snapshot list does not show $snap once"
# Nodes publish the templates they have (a snapshot is one): requests about
# it go to them first, so its forks run on $ob, which need not take it in.
has_template() { # NODE NAME
    ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" get --print-value-only "/sandfork/v1/nodes/$1" |
        python3 -c 'import json, sys; sys.exit(sys.argv[1] not in json.load(sys.stdin)["load"].get("templates", []))' "$2"
}
start=$SECONDS
until has_template "$ob" "$snap" && has_template "$ob" "$snap_name"; do
    ((SECONDS - start < 30)) || die "$ob does not publish that it has $snap ($snap_name)"
    sleep 1
done
for i in 1 2; do
    answer=$(api -X POST -d '{"count": 1}' "$SANDFORK_API_URL/snapshots/$snap/fork") ||
        die "fork of snapshot $snap through the gateway"
    child=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])[0]["sandbox"]["sandboxID"])' "$answer") ||
        die "fork $i of snapshot $snap: $answer"
    [[ $(owner "$child") == "$ob" ]] || die "a fork of $snap (on $ob) ran on $(owner "$child")"
    [[ $("$bin" exec "$child" -- echo "child $i") == "child $i" ]] || die "exec in $child"
    "$bin" rm "$child" || die "kill $child"
done
log "PASS: snapshot $snap of $b listed once and forked twice through the gateway, on $ob"
t0=$SECONDS
stored_snap() { curl -s -o /dev/null -w '%{http_code}' "$SANDFORK_S3/templates/$snap.json"; }
until [[ $(stored_snap) == 200 ]]; do
    ((SECONDS - t0 < 300)) || die "snapshot $snap is not in the object store after 300 s"
    sleep 1
done
other=$oa
[[ $other != "$ob" ]] || other=n1
other_api=http://127.0.0.1:${ports[${other#n} - 1]}
stored_name() { curl -s -o /dev/null -w '%{http_code}' "$SANDFORK_S3/template-names/$snap_name.json"; }
[[ $(stored_name) == 200 ]] || die "the object store has no index of the name $snap_name"
taken=$(SANDFORK_API_URL=$other_api "$bin" create "$snap_name" --timeout 300) ||
    die "create from $snap_name straight to $other (its maker: $ob)"
[[ $(owner "$taken") == "$other" ]] || die "$taken is on $(owner "$taken"), not $other"
got=$("$bin" exec "$taken" -- sh -c 'cat ~/snap.txt') || die "reading in $taken"
[[ $got == snapped ]] || die "$taken (from $snap_name, taken in on $other) read '$got'"
grep -q "template $snap taken in from node $ob" "$work/$other.log" || die "$other does not say it took $snap in"
"$bin" rm "$taken" || die "kill $taken"
# Creates from it through the gateway go to $ob and $other, not to the
# third node (freer: a and b run on the others), until those are clearly
# fuller.
start=$SECONDS
until has_template "$ob" "$snap_name" && has_template "$other" "$snap_name"; do
    ((SECONDS - start < 30)) || die "$ob and $other do not publish that they have $snap_name"
    sleep 1
done
for third in n1 n2 n3; do [[ $third == "$ob" || $third == "$other" ]] || break; done
! has_template "$third" "$snap_name" || die "$third publishes $snap_name, which it never took in"
from_name=()
for i in 1 2; do
    from_name+=("$("$bin" create "$snap_name" --timeout 300)") || die "create $i from $snap_name through the gateway"
done
for id in "${from_name[@]}"; do
    on=$(owner "$id")
    [[ $on != "$third" ]] || die "a create from $snap_name went to $third, which lacks it ($ob and $other have it)"
done
"$bin" rm "${from_name[@]}" || die "kill the creates from $snap_name"
# A delete through the gateway reaches both copies and the store's.
api -f -X DELETE "$SANDFORK_API_URL/templates/$snap" || die "delete of $snap through the gateway"
for port in "${ports[@]}"; do
    code=$(api -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/templates/$snap")
    [[ $code == 404 ]] || die "node at $port answers $code for the deleted $snap"
done
[[ $(stored_snap) == 404 ]] || die "the deleted $snap is still in the object store"
[[ $(stored_name) == 404 ]] || die "the deleted $snap's name $snap_name is still in the object store"
code=$(api -o /dev/null -w '%{http_code}' -X DELETE "$SANDFORK_API_URL/templates/$snap")
[[ $code == 404 ]] || die "a second delete of $snap answered $code"
log "PASS: snapshot $snap (of $b on $ob) stored, taken in by name by a create straight to $other (file intact), creates from it placed on the two that have it, deleted on every node and the store ($((SECONDS - t0)) s)"
"$bin" rm "$a" || die "kill $a"
"$bin" rm "$b" || die "kill $b"
# A node's 2 s reconcile may claim a sandbox it listed just before the
# kill; its next pass releases it again.
start=$SECONDS
until [[ -z $(ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" get --prefix --keys-only /sandfork/v1/sandboxes/) ]]; do
    ((SECONDS - start < 10)) || die "records left after the kills"
    sleep 0.5
done
listed=$("$bin" ls)
! grep -q "$a" <<<"$listed" || die "$a still listed after its kill"
log "PASS: create, exec, ls and kill through the gateway on 3 nodes"

# --- the E2B SDK through the gateways -----------------------------------------
# The unmodified Python SDK's tests of creates and the lifecycle (pause and
# connect, forks, snapshots), and those of its command and file tests that
# stream through the envd proxy (output, stdin, a reconnect, a large
# transfer, a watch, signed URLs; the rest differ from these only inside
# the guest, and run against one node in the SDK job): its control plane
# through one gateway, its envd traffic through the other, the sandboxes
# placed over the nodes (pauses stored, forks spread).
# (SANDFORK_CLUSTER_SDK=all: the four files whole, 40 tests, 4 more minutes)
t0=$SECONDS
sdk_tests=("$root"/tests/sdk/python/{test_create,test_lifecycle}.py)
if [[ ${SANDFORK_CLUSTER_SDK:-} == all ]]; then
    sdk_tests+=("$root"/tests/sdk/python/{test_commands,test_files}.py)
else
    for t in stdout_and_exit_code streaming_callbacks stdin connect_to_running_command background_list_and_kill; do
        sdk_tests+=("$root/tests/sdk/python/test_commands.py::test_$t")
    done
    for t in write_and_read_text large_file_upload_and_download watch_dir signed_urls; do
        sdk_tests+=("$root/tests/sdk/python/test_files.py::test_$t")
    done
fi
E2B_API_URL=http://127.0.0.1:$gw E2B_SANDBOX_URL=http://127.0.0.1:$gw2 E2B_API_KEY=$SANDFORK_API_KEY \
    PYTHONDONTWRITEBYTECODE=1 "${SDK_PYTHON:?the host part sets it}" -m pytest -p no:cacheprovider -q \
    "${sdk_tests[@]}" >"$work/sdk.log" 2>&1 ||
    { tail -n 40 "$work/sdk.log" >&2; die "the SDK's tests through the gateways failed (log: $work/sdk.log)"; }
log "PASS: the Python SDK's tests through the gateways (${#sdk_tests[@]} files or tests): $(tail -n 1 "$work/sdk.log") ($((SECONDS - t0)) s)"

# --- creates per second: one node, then all three through a gateway ----------
# 8 creates at once straight to one node, then 8 through the gateway (placed
# over the three). The nodes share the lab's one emulated CPU, so this shows
# what the gateway and placement cost more than how the cluster scales.
creates_per_s() { # URL: prints creates per second of 8 at once
    local url=$1 start_us pids=() pid i
    start_us=${EPOCHREALTIME/./}
    for i in 1 2 3 4 5 6 7 8; do
        SANDFORK_API_URL=$url "$bin" create --timeout 300 >"$work/create.$i" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || die "a create through $url failed"; done
    python3 -c "print(round(8e6 / (${EPOCHREALTIME/./} - $start_us), 3))"
    for i in 1 2 3 4 5 6 7 8; do "$bin" rm "$(cat "$work/create.$i")" >/dev/null || die "kill after the creates"; done
}
creates_1node=$(creates_per_s "http://127.0.0.1:${ports[0]}")
creates_cluster=$(creates_per_s "$SANDFORK_API_URL")
log "creates per second (8 at once): $creates_1node straight to n1, $creates_cluster through the gateway on 3 nodes"

# --- etcd loses its leader during a create burst -------------------------------
# Six creates through both gateways; the leading member is killed (SIGKILL)
# once they are under way. Each create answers (made, or a clear error) and
# the routes are exactly the sandboxes made: none lost, none twice, none
# for a create that failed. The member then comes back on its data.
t0=$SECONDS
routes() { ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" get --prefix --keys-only /sandfork/v1/sandboxes/ | grep -c . || true; }
mapped=$(routes)
leader=$(etcd_leader)
[[ $leader == [123] ]] || die "no etcd member leads ($leader)"
burst=()
for i in 0 1 2 3 4 5; do
    port=$gw
    ((i % 2)) && port=$gw2
    SANDFORK_API_URL=http://127.0.0.1:$port "$bin" create --timeout 900 >"$work/burst.$i" 2>&1 &
    burst+=($!)
done
sleep 1
kill -9 "${etcd_pid[$leader]}"
made_in_burst=()
for i in "${!burst[@]}"; do
    if wait "${burst[i]}"; then
        made_in_burst+=("$(cat "$work/burst.$i")")
    else
        log "a create while etcd lost its leader failed: $(cat "$work/burst.$i")"
    fi
done
start=$SECONDS
until new_leader=$(etcd_leader) && [[ $new_leader == [123] ]]; do
    ((SECONDS - start < 60)) || die "no new etcd leader 60 s after member $leader's loss"
    sleep 1
done
[[ $new_leader != "$leader" ]] || die "member $leader leads after its loss"
# Creates go on under the new leader.
after=$("$bin" create --timeout 900) || die "a create after etcd's new leader"
made_in_burst+=("$after")
[[ $(routes) == $((mapped + ${#made_in_burst[@]})) ]] ||
    die "after the burst $(routes) sandboxes are mapped, not $mapped + ${#made_in_burst[@]} made (one after it)"
for id in "${made_in_burst[@]}"; do
    [[ -n $(route_of "$id") ]] || die "$id was made but has no route"
    [[ $("$bin" exec "$id" -- echo up) == up ]] || die "$id (made while etcd changed leaders) does not answer"
done
start_etcd "$leader"
"$bin" rm "${made_in_burst[@]}" || die "kill the burst's sandboxes"
[[ $(routes) == "$mapped" ]] || die "after the burst's kills $(routes) sandboxes are mapped, not $mapped"
for n in n1 n2 n3; do registered "$n" || die "node $n lost its registration while etcd changed leaders"; done
log "PASS: etcd member $leader (the leader) killed during 6 creates through both gateways: $((${#made_in_burst[@]} - 1)) made, each mapped once and answering, nothing else mapped; member $new_leader leads, a create after it works, the nodes still registered ($((SECONDS - t0)) s)"

# --- etcd loses its quorum -----------------------------------------------------
# Two of the three members killed (SIGKILL): a running sandbox still answers
# through both gateways (each routes by the map it last had; its node
# answers for it); a create answers 503 (etcd failing is the
# same on every node, so the gateway does not try each) and leaves
# nothing behind. Once the members are back, creates work, the sandbox
# answers, nothing was lost and every node is registered.
t0=$SECONDS
q=$("$bin" create --timeout 900) || die "create before the quorum loss"
"$bin" exec "$q" -- sh -c 'cd && echo kept > q.txt' || die "writing in $q"
mapped=$(routes)
held_by_nodes() { # what every node lists (asked directly, not through etcd)
    local port
    for port in "${ports[@]}"; do
        api "http://127.0.0.1:$port/sandboxes" | python3 -c 'import json, sys
print(*sorted(s["sandboxID"] for s in json.load(sys.stdin)))'
    done
}
held_before=$(held_by_nodes)
kill -9 "${etcd_pid[1]}" "${etcd_pid[2]}"
for port in "$gw" "$gw2"; do
    got=$(SANDFORK_API_URL=http://127.0.0.1:$port "$bin" exec "$q" -- sh -c 'cat ~/q.txt') ||
        die "exec in $q through the gateway at $port without an etcd quorum"
    [[ $got == kept ]] || die "$q read '$got' without an etcd quorum"
done
t=$SECONDS
code=$(api -o "$work/quorum-create.json" -w '%{http_code}' -m 120 -X POST -d '{"templateID": "base", "timeout": 300}' \
    "$SANDFORK_API_URL/sandboxes")
no_quorum_create_s=$((SECONDS - t))
[[ $code == 503 ]] || die "a create without an etcd quorum answered $code: $(cat "$work/quorum-create.json")"
grep -q 'cluster state' "$work/quorum-create.json" || die "the 503 of a create without a quorum: $(cat "$work/quorum-create.json")"
[[ $(held_by_nodes) == "$held_before" ]] ||
    die "the nodes hold $(held_by_nodes) after a create refused without a quorum, not $held_before"
start_etcd 1
start_etcd 2
start=$SECONDS
until quorum_leader=$(etcd_leader) && [[ $quorum_leader == [123] ]]; do
    ((SECONDS - start < 60)) || die "no etcd leader 60 s after the members came back"
    sleep 1
done
start=$SECONDS
until back=$("$bin" create --timeout 900 2>"$work/quorum-back.err"); do
    ((SECONDS - start < 60)) || die "no create 60 s after etcd's quorum came back: $(cat "$work/quorum-back.err")"
    sleep 2
done
# (a node whose lease ran out meanwhile registers anew and moves its
# routes to the new lease within a reconcile)
start=$SECONDS
until [[ $("$bin" exec "$q" -- sh -c 'cat ~/q.txt' 2>"$work/quorum-exec.err") == kept ]]; do
    ((SECONDS - start < 60)) || die "$q after the quorum came back: $(cat "$work/quorum-exec.err")"
    sleep 1
done
[[ $(routes) == $((mapped + 1)) ]] || die "after the quorum loss $(routes) sandboxes are mapped, not $mapped + 1"
for n in n1 n2 n3; do registered "$n" || die "node $n is not registered after the quorum came back"; done
"$bin" rm "$q" "$back" || die "kill $q and $back"
log "PASS: etcd without a quorum: $q answered through both gateways, a create answered 503 in $no_quorum_create_s s and left nothing; back, a create worked, nothing lost, every node registered ($((SECONDS - t0)) s)"

# --- a fork across nodes -------------------------------------------------------
# n3 has room for its parent and 2 children (--max-sandboxes 3): a fork of 8
# of a sandbox there makes 2 children on it and 6 on the other nodes, which
# fetch the frozen fork's files from it (node to node, not the object
# store). Every child writes a value of its own and reads it back; the
# parent is unaffected. Timed from the fork call until all 8 children have
# answered a command.
t0=$SECONDS
left=$(SANDFORK_API_URL=$n3_api "$bin" ls --json | python3 -c 'import json, sys; print(" ".join(s["sandboxID"] for s in json.load(sys.stdin)))')
[[ -z $left ]] || die "n3 holds sandboxes before the fork: $left"
parent=$(SANDFORK_API_URL=$n3_api "$bin" create --timeout 900) || die "create on n3"
[[ $(owner "$parent") == n3 ]] || die "$parent is on $(owner "$parent"), not n3"
"$bin" exec "$parent" -- sh -c 'cd && echo parent > who.txt' || die "writing in $parent"
t=$(now_ms)
answer=$(api -X POST -d '{"count": 8, "timeout": 900}' "$SANDFORK_API_URL/sandboxes/$parent/fork") ||
    die "fork of 8 of $parent through the gateway"
# A here-string, not a process substitution: the lab has no /dev/fd.
ids=$(python3 -c 'import json, sys
for entry in json.loads(sys.argv[1]):
    print(entry["sandbox"]["sandboxID"] if "sandbox" in entry else "ERROR " + json.dumps(entry))' "$answer") ||
    die "the fork's answer: $answer"
mapfile -t children <<<"$ids"
((${#children[@]} == 8)) || die "a fork of 8 answered ${#children[@]} entries: $answer"
for child in "${children[@]}"; do
    [[ $child != ERROR* ]] || die "a child of the fork of 8 failed: $child"
done
# Every child answers a command (the first sees the parent's file).
firsts=()
for i in "${!children[@]}"; do
    "$bin" exec "${children[i]}" -- sh -c 'cat ~/who.txt' >"$work/xfork.$i" 2>&1 &
    firsts+=($!)
done
for i in "${!firsts[@]}"; do
    wait "${firsts[i]}" || die "the first command in ${children[i]}: $(cat "$work/xfork.$i")"
done
cross_node_fork8_ms=$(($(now_ms) - t))
for i in "${!children[@]}"; do
    [[ $(cat "$work/xfork.$i") == parent ]] || die "${children[i]} saw '$(cat "$work/xfork.$i")', not the parent's file"
done
local_children=0 remote_children=0
declare -A on_node=()
for child in "${children[@]}"; do
    child_node=$(owner "$child")
    on_node[$child_node]=$((${on_node[$child_node]:-0} + 1))
    if [[ $child_node == n3 ]]; then
        local_children=$((local_children + 1))
    else
        remote_children=$((remote_children + 1))
    fi
done
placed=$(for n in "${!on_node[@]}"; do echo -n "$n: ${on_node[$n]} "; done)
((local_children == 2 && remote_children == 6)) ||
    die "the fork of 8 put $local_children children on n3 and $remote_children elsewhere, not 2 and 6 ($placed)"
# The other nodes fetched the fork's files from n3.
grep -q "fork .* of sandbox $parent on node n3: fetched" "$work"/n1.log "$work"/n2.log ||
    die "no node says it fetched the fork's files from n3"
# Each child diverges: its own value written, its own read back.
for i in "${!children[@]}"; do
    "$bin" exec "${children[i]}" -- sh -c "cd && echo child-$i > who.txt" || die "writing in ${children[i]}"
done
for i in "${!children[@]}"; do
    got=$("$bin" exec "${children[i]}" -- sh -c 'cat ~/who.txt') || die "reading in ${children[i]}"
    [[ $got == "child-$i" ]] || die "${children[i]} (on $(owner "${children[i]}")) read '$got', not child-$i"
done
[[ $("$bin" exec "$parent" -- sh -c 'cat ~/who.txt') == parent ]] || die "the parent $parent lost its file"
# A client that hangs up in the middle of a fork of 2 (n3 is full: both go
# to other nodes): what they made for it is removed, nothing is left mapped.
mapped=$(routes)
api -m 2 -X POST -d '{"count": 2, "timeout": 900}' "$n3_api/sandboxes/$parent/fork" >/dev/null &&
    die "the fork of 2 answered within 2 s: no hang-up to test"
start=$SECONDS
until grep -q "removed the 2 fork children other nodes made for it" "$work/n3.log"; do
    ((SECONDS - start < 300)) || die "n3 did not remove the fork children its hung-up client left"
    sleep 1
done
[[ $(routes) == "$mapped" ]] || die "after the hung-up fork $(routes) sandboxes are mapped, not $mapped"
"$bin" rm "${children[@]}" "$parent" || die "kill the fork's sandboxes"
for id in "${children[@]}" "$parent"; do
    [[ -z $(route_of "$id") ]] || die "$id is still mapped after its kill"
done
log "PASS: a fork of 8 on n3 (room for 2): 2 children on n3 and 6 on other nodes (which fetched its files from n3), each with its own file, the parent unaffected, a hung-up fork's remote children removed; all answered a command $cross_node_fork8_ms ms after the fork call ($((SECONDS - t0)) s in all; children per node: ${placed% })"

# --- a team's limit holds across gateways and nodes --------------------------
# The team is made through one gateway (so on one node), its key through the
# other: both are in etcd, and every node accepts the key.
team=$("$bin" team create quota --max-sandboxes 2) || die "team create through $gw"
key=$(SANDFORK_API_URL=http://127.0.0.1:$gw2 "$bin" key create "$team") || die "key create through $gw2"
as_team() { # GATEWAY_PORT ARGS...: the CLI as the team through that gateway
    local port=$1
    shift
    SANDFORK_API_URL=http://127.0.0.1:$port SANDFORK_API_KEY=$key "$bin" "$@"
}
# Six creates at once, three through each gateway, placed over both nodes.
creators=()
for i in 1 2 3 4 5 6; do
    port=$gw
    ((i % 2)) || port=$gw2
    as_team "$port" create --timeout 900 >"$work/q$i.out" 2>"$work/q$i.err" &
    creators+=($!)
done
made=() refused=0
for i in 1 2 3 4 5 6; do
    if wait "${creators[i - 1]}"; then
        made+=("$(cat "$work/q$i.out")")
    elif grep -q 'maximum number of concurrent sandboxes (2)' "$work/q$i.err"; then
        refused=$((refused + 1))
    else
        die "create $i as the team failed otherwise: $(cat "$work/q$i.err")"
    fi
done
((${#made[@]} == 2 && refused == 4)) || die "a team of 2 got ${#made[@]} sandboxes from 6 racing creates (${refused} refused)"
slots() { ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" get --prefix --keys-only "/sandfork/v1/teams/$team/running/" | grep -c . || true; }
[[ $(slots) == 2 ]] || die "the team holds $(slots) slots for 2 sandboxes"
listed=$(as_team "$gw2" ls --json | python3 -c 'import json, sys; print(len(json.load(sys.stdin)))')
[[ $listed == 2 ]] || die "the team lists $listed sandboxes"
# The gateway sums the team's use over the nodes.
made_on="$(owner "${made[0]}") and $(owner "${made[1]}")"
used=$(curl -sf -H "X-API-Key: $SANDFORK_API_KEY" "http://127.0.0.1:$gw/admin/teams/$team" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["usage"]["sandboxes"])') || die "the team's use"
[[ $used == 2 ]] || die "the gateway says the team uses $used sandboxes (on $made_on)"
# A pause gives a slot back: a create fits, and the paused one's resume
# is then refused until a kill frees one.
as_team "$gw" pause "${made[0]}" >/dev/null || die "pausing ${made[0]}"
third=$(as_team "$gw2" create --timeout 900) || die "a create after a pause"
if as_team "$gw" resume "${made[0]}" 2>"$work/q-resume.err"; then
    die "the resume of ${made[0]} went beyond the team's 2"
fi
grep -q 'maximum number of concurrent sandboxes (2)' "$work/q-resume.err" || die "resume refused otherwise: $(cat "$work/q-resume.err")"
# A fork of a full team makes no child.
fork_code=$(curl -s -o "$work/q-fork.json" -w '%{http_code}' -X POST -H "X-API-Key: $key" -H 'Content-Type: application/json' \
    -d '{"count": 1}' "http://127.0.0.1:$gw2/sandboxes/${made[1]}/fork")
[[ $fork_code == 429 ]] || die "a fork of a full team answered $fork_code: $(cat "$work/q-fork.json")"
as_team "$gw2" rm "$third" >/dev/null || die "kill $third"
as_team "$gw" resume "${made[0]}" >/dev/null || die "resuming ${made[0]} after a kill"
[[ $(as_team "$gw2" exec "${made[0]}" -- echo back) == back ]] || die "exec in the resumed ${made[0]}"
as_team "$gw" rm "${made[@]}" >/dev/null || die "kill the team's sandboxes"
[[ $(slots) == 0 ]] || die "the team holds $(slots) slots after its kills"
log "PASS: a team of 2: 6 creates racing through 2 gateways made 2 (4 refused, 429; on $made_on, use 2 through the gateway); a pause freed a slot, a resume and a fork beyond the limit were refused"

# --- a durable pause survives its node ---------------------------------------
t0=$SECONDS
c=$("$bin" create --timeout 900) || die "create for the pause"
# (in the guest user's home: commands run as E2B's `user`; the tick is
# renamed into place, so a read never finds it empty halfway through a write)
"$bin" exec "$c" -- sh -c 'cd && echo kept > kept.txt && setsid sh -c "while :; do date +%s%N > ~/tick.new && mv ~/tick.new ~/tick; sleep 0.2; done" </dev/null >/dev/null 2>&1 & echo $! > ~/loop.pid' ||
    die "starting a process in $c"
loop=$("$bin" exec "$c" -- sh -c 'sleep 1; cat ~/loop.pid') || die "reading the loop's pid"
from=$(owner "$c")
pause() { # ID: a durable pause through the gateway
    curl -sf -X POST -H "X-API-Key: $SANDFORK_API_KEY" -H 'Content-Type: application/json' -d '{}' \
        -D "$work/pause.headers" "$SANDFORK_API_URL/sandboxes/$1/pause" >/dev/null || die "pausing $1"
    grep -qi '^x-sandfork-durable: true' "$work/pause.headers" || die "the pause of $1 is not durable: $(cat "$work/pause.headers")"
}
# A durable pause and a resume on the same node, for comparison; then the
# second pause stores only what changed.
t=$(now_ms); pause "$c"; first_pause_ms=$(($(now_ms) - t))
t=$(now_ms); "$bin" resume "$c" >/dev/null || die "resuming $c on $from"; same_node_resume_ms=$(($(now_ms) - t))
[[ $(owner "$c") == "$from" ]] || die "$c moved on a resume while $from lived"
t=$(now_ms); pause "$c"; pause_ms=$(($(now_ms) - t))
pause_s=$((pause_ms / 1000))
route=$(route_of "$c")
grep -q '"paused"' <<<"$route" || die "the route of $c records no durable pause: $route"
# A sandbox paused at its timeout (no API call) is stored by its node too.
on_from=http://127.0.0.1:${ports[${from#n} - 1]}
ap=$(SANDFORK_API_URL=$on_from "$bin" create --auto-pause --timeout 20) || die "create with auto-pause on $from"
"$bin" exec "$ap" -- sh -c 'cd && echo auto > auto.txt' || die "writing in $ap"
start=$SECONDS
until_stored "$ap" "the pause of $ap at its timeout was not stored"
log "$ap paused at its timeout and stored by $from in $((SECONDS - start)) s after the write"
# A sandbox running on the same node (created there directly) is lost with it,
# and so is one paused there by choice (`--local`: never stored).
d=$(SANDFORK_API_URL=$on_from "$bin" create --timeout 900) || die "create on $from"
l=$(SANDFORK_API_URL=$on_from "$bin" create --timeout 900) || die "create on $from"
curl -sf -X POST -H "X-API-Key: $SANDFORK_API_KEY" -H 'Content-Type: application/json' -d '{"durable": false}' \
    -D "$work/pause.headers" "$SANDFORK_API_URL/sandboxes/$l/pause" >/dev/null || die "pausing $l on its node only"
grep -qi '^x-sandfork-durable: false' "$work/pause.headers" || die "the local pause of $l says: $(cat "$work/pause.headers")"
sleep 5 # two reconcile passes, which store what a pause left unstored
! grep -q '"paused"' <<<"$(route_of "$l")" || die "the pause of $l, asked to stay on $from, was stored"
log "$c paused on $from and stored in $pause_s s, $d running there; killing $from (SIGKILL) and removing its data"
kill -9 "${node_pid[$from]}"
rm -rf "${work:?}/$from"
# Its lease ends within the TTL (3 s); until then the gateway routes to it.
start=$SECONDS
while registered "$from"; do
    ((SECONDS - start < 30)) || die "node $from is still registered"
    sleep 0.5
done
# The running one is lost: a clear answer, and a kill forgets it.
lost=$(curl -s -H "X-API-Key: $SANDFORK_API_KEY" -w ' %{http_code}' "$SANDFORK_API_URL/sandboxes/$d")
[[ $lost == *lost*" 410" ]] || die "sandbox $d on the dead node: $lost"
"$bin" nodes --json | python3 -c 'import json, sys
lost = [o["sandboxID"] for o in json.load(sys.stdin)["withoutNode"] if o["state"] == "lost"]
sys.exit(sys.argv[1] not in lost)' "$d" || die "sandfork nodes does not show $d lost: $("$bin" nodes --json)"
"$bin" rm "$d" || die "kill the lost $d"
lost=$(curl -s -H "X-API-Key: $SANDFORK_API_KEY" -w ' %{http_code}' "$SANDFORK_API_URL/sandboxes/$l")
[[ $lost == *lost*" 410" ]] || die "sandbox $l, paused on the dead node only: $lost"
"$bin" rm "$l" || die "kill the lost $l"
[[ -z $(ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" get --keys-only "/sandfork/v1/sandboxes/$d") ]] ||
    die "the lost $d is still mapped"
t=$(now_ms)
"$bin" resume "$c" || die "resuming $c through the gateway after its node died"
cross_node_resume_ms=$(($(now_ms) - t))
resume_s=$((cross_node_resume_ms / 1000))
to=$(owner "$c")
[[ $to != "$from" ]] || die "$c still on $from"
[[ $("$bin" exec "$c" -- sh -c 'cat ~/kept.txt') == kept ]] || die "the file in $c is gone"
still=$("$bin" exec "$c" -- sh -c "kill -0 $loop && echo alive") || die "looking for the loop in $c"
[[ $still == alive ]] || die "the process $loop in $c is gone"
a1=$("$bin" exec "$c" -- sh -c 'cat ~/tick')
sleep 1
a2=$("$bin" exec "$c" -- sh -c 'cat ~/tick')
((a2 > a1)) || die "the process in $c does not run on ($a1, then $a2)"
"$bin" rm "$c" || die "kill $c"
"$bin" resume "$ap" >/dev/null || die "resuming $ap (paused at its timeout) after its node died"
ap_to=$(owner "$ap")
[[ $ap_to != "$from" ]] || die "$ap still on $from"
[[ $("$bin" exec "$ap" -- sh -c 'cat ~/auto.txt') == auto ]] || die "the file in $ap is gone"
"$bin" rm "$ap" || die "kill $ap"
log "PASS: $c paused on $from (stored in $pause_s s), $from killed, resumed on $to in $resume_s s with its file and process, and $ap paused at its timeout resumed on $ap_to; $l, paused there by choice only, lost with it ($((SECONDS - t0)) s in all)"

# --- a node cut off from etcd: only one copy serves ---------------------------
# $from comes back, fresh, in the namespace whose link the test takes down.
t0=$SECONDS
cut_port=$(free_port)
cut_api=http://$cut_node:$cut_port
in_cut_ns env SANDFORK_ETCD="$(endpoints "$cut_host")" SANDFORK_S3="http://$cut_host:$s3_port/sandfork" \
    "$bin" serve --in-lab --role node --node-id "$from" --listen "$cut_node:$cut_port" \
    --data-dir "$work/$from" --no-network --pool-size 1 --lease-ttl-secs 3 >"$work/$from-cut.log" 2>&1 &
pids+=($!)
start=$SECONDS
until curl -sf "$cut_api/health" >/dev/null && registered "$from"; do
    ((SECONDS - start < 800)) || { tail -n 30 "$work/$from-cut.log" >&2; die "$from did not come back"; }
    sleep 1
done
e=$(SANDFORK_API_URL=$cut_api "$bin" create --timeout 900) || die "create on $from"
g=$(SANDFORK_API_URL=$cut_api "$bin" create --timeout 900) || die "second create on $from"
k=$(SANDFORK_API_URL=$cut_api "$bin" create --timeout 900) || die "third create on $from"
"$bin" exec "$e" -- sh -c 'cd && echo before > state.txt' || die "writing in $e"
pause "$e"
ip link set "$cut_link" down
start=$SECONDS
while registered "$from"; do
    ((SECONDS - start < 30)) || die "node $from is still registered with its link down"
    sleep 0.5
done
# What runs there is out of reach meanwhile.
lost=$(curl -s -H "X-API-Key: $SANDFORK_API_KEY" -w ' %{http_code}' "$SANDFORK_API_URL/sandboxes/$g")
[[ $lost == *lost*" 410" ]] || die "sandbox $g on the cut-off node: $lost"
# A kill of a lost one through the gateway holds when its node is back.
"$bin" rm "$k" || die "kill the lost $k"
# Its pause is in the store: it resumes on the other node and changes there.
"$bin" resume "$e" >/dev/null || die "resuming $e while $from is cut off"
e_to=$(owner "$e")
[[ $e_to != "$from" ]] || die "$e resumed on $from, which is cut off"
"$bin" exec "$e" -- sh -c 'cd && cat state.txt && echo after > state.txt' | grep -qx before ||
    die "$e lost its file on $e_to"
ip link set "$cut_link" up
# Back, $from must not serve its old copy (a resume is refused: the route
# is $e_to's) and removes it.
start=$SECONDS
until [[ $(curl -s -o /dev/null -w '%{http_code}' -H "X-API-Key: $SANDFORK_API_KEY" "$cut_api/sandboxes/$e") == 404 ]]; do
    code=$(curl -s -o "$work/cut-resume.json" -w '%{http_code}' -X POST -H "X-API-Key: $SANDFORK_API_KEY" \
        -H 'Content-Type: application/json' -d '{}' "$cut_api/sandboxes/$e/resume")
    [[ $code != 2* ]] || die "$from resumed its stale copy of $e: $(cat "$work/cut-resume.json")"
    ((SECONDS - start < 120)) || { tail -n 20 "$work/$from-cut.log" >&2; die "$from still holds its copy of $e"; }
    sleep 1
done
[[ ! -e $work/$from/sandboxes/$e ]] || die "$from left the files of its stale copy of $e"
grep -q "sandbox $e is node $e_to's now" "$work/$from-cut.log" || die "$from did not say why it removed $e"
registered "$from" || die "$from did not register again"
[[ $(owner "$e") == "$e_to" ]] || die "$e moved to $(owner "$e") after the link came back"
[[ $("$bin" exec "$e" -- sh -c 'cat ~/state.txt') == after ]] || die "$e is not the copy on $e_to"
# What ran on $from is its again, under its new lease, but the one killed.
start=$SECONDS
until [[ $("$bin" exec "$g" -- echo back 2>/dev/null) == back ]]; do
    ((SECONDS - start < 60)) || die "$g on $from is not reachable after the link came back"
    sleep 1
done
# (its tombstone goes once the copy is gone)
tombstones() { ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" get --prefix --keys-only /sandfork/v1/killed/; }
start=$SECONDS
until [[ $(curl -s -o /dev/null -w '%{http_code}' -H "X-API-Key: $SANDFORK_API_KEY" "$cut_api/sandboxes/$k") == 404 &&
    -z $(tombstones) ]]; do
    ((SECONDS - start < 60)) || die "$from still holds $k, killed while it was cut off (tombstones: $(tombstones))"
    sleep 1
done
[[ -z $(ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" get --keys-only "/sandfork/v1/sandboxes/$k") ]] ||
    die "$k, killed while $from was cut off, is mapped again"
"$bin" rm "$e" "$g" || die "kill $e and $g"
[[ -z $(ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" get --keys-only "/sandfork/v1/sandboxes/$g") ]] ||
    die "the kill of $g left its route"
log "PASS: $from cut off from etcd: $e resumed on $e_to meanwhile, $g and $k lost and $k killed; back, $from refused and removed its stale copy of $e, removed $k and serves $g again ($((SECONDS - t0)) s in all)"

# --- the object store down: pauses stay on their node -------------------------
kill -9 "$weed_pid"
f=$("$bin" create --timeout 900) || die "create with the object store down"
"$bin" exec "$f" -- sh -c 'cd && echo local > local.txt' || die "writing in $f"
curl -sf -X POST -H "X-API-Key: $SANDFORK_API_KEY" -H 'Content-Type: application/json' -d '{}' \
    -D "$work/pause.headers" "$SANDFORK_API_URL/sandboxes/$f/pause" >/dev/null || die "pausing $f with the object store down"
grep -qi '^x-sandfork-durable: false' "$work/pause.headers" || die "the pause of $f says: $(cat "$work/pause.headers")"
route=$(route_of "$f")
! grep -q '"paused"' <<<"$route" || die "the route of $f records a durable pause: $route"
grep -q "sandbox $f: its pause is not in the object store" "$work"/n*.log || die "no warning for the pause of $f"
# Back, the store gets that pause too (the node tries again every 30 s).
weed "${weed_args[@]}" >>"$work/weed.log" 2>&1 &
pids+=($!)
start=$SECONDS
until_stored "$f" "the pause of $f was not stored once the object store was back"
stored_after=$((SECONDS - start))
"$bin" resume "$f" >/dev/null || die "resuming $f on its node"
[[ $("$bin" exec "$f" -- sh -c 'cat ~/local.txt') == local ]] || die "$f lost its file"
"$bin" rm "$f" || die "kill $f"
log "PASS: with the object store down, a pause stayed on its node (durable: false, with a warning), was stored $stored_after s after the store came back, and resumed"
# Lab figures (emulated: compare them as ratios within one run).
log "bench: {\"gateway_exec_ms\": $via_gateway_ms, \"direct_exec_ms\": $direct_ms, \"durable_pause_first_ms\": $first_pause_ms, \"durable_pause_again_ms\": $pause_ms, \"same_node_resume_ms\": $same_node_resume_ms, \"cross_node_resume_ms\": $cross_node_resume_ms, \"cluster_creates_per_s_1node\": $creates_1node, \"cluster_creates_per_s_3nodes\": $creates_cluster, \"cross_node_fork8_ms\": $cross_node_fork8_ms}"
