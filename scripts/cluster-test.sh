#!/bin/bash
# Two sandfork nodes behind one gateway, with a real etcd member, all on
# loopback inside the KVM lab (one lab machine; the nodes' sandboxes are
# real microVMs, run with --no-network since two nodes on one host would
# take the same network slot names and ranges). Through the gateway: create,
# run a command, list, kill; and both nodes registered.
#
# Usage: scripts/cluster-test.sh [--no-build]
# Env: CARGO_TARGET_DIR (default target), SANDFORK_LAB_LOCKED (the caller
#      holds the lab lock).
# Out: logs in $target/cluster-test/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
log() { echo "cluster-test: $*" >&2; }
die() { log "FAIL: $*"; exit 1; }
target=${CARGO_TARGET_DIR:-$root/target}
rw=/var/cache/sandfork/lab-rw

if [[ ${1:-} != --inside ]]; then
    if [[ ${1:-} != --no-build ]]; then
        scripts/build.sh
    fi
    set -a
    # shellcheck source=/dev/null  # written by scripts/build.sh
    . target/sandfork.env
    set +a
    cargo build -p sandfork -p sandfork-lab -p sandfork-vmm --quiet
    mkdir -p "$rw"
    lab=("$target/debug/sandfork-lab" run --cpus 1 --timeout 900 --rw "$rw" --
        env "CARGO_TARGET_DIR=$target" "SANDFORK_KERNEL=$SANDFORK_KERNEL"
        "SANDFORK_ROOTFS=$SANDFORK_ROOTFS"
        "SANDFORK_VMM=${SANDFORK_VMM:-$target/debug/sandfork-vmm}" bash "$root/scripts/cluster-test.sh" --inside)
    if [[ -z ${SANDFORK_LAB_LOCKED:-} ]]; then
        lab=(flock /tmp/sandfork-lab.lock "${lab[@]}")
    fi
    exec "${lab[@]}"
fi

# Inside the lab: /work is read-only, $rw is writable.
work=$(mktemp -d "$rw/cluster-test.XXXXXX")
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work/n1" "$work/n2" "$work/etcd"
}
trap cleanup EXIT
bin=$target/debug/sandfork
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
etcd_port=$(free_port)
etcd --name=t --data-dir="$work/etcd" \
    --listen-client-urls="http://127.0.0.1:$etcd_port" --advertise-client-urls="http://127.0.0.1:$etcd_port" \
    --listen-peer-urls="http://127.0.0.1:$(free_port)" >"$work/etcd.log" 2>&1 &
pids+=($!)
export SANDFORK_ETCD=http://127.0.0.1:$etcd_port
export SANDFORK_API_KEY=sandfork_cluster_test_$RANDOM$RANDOM
ports=()
for n in 1 2; do
    port=$(free_port)
    ports+=("$port")
    "$bin" serve --in-lab --role node --node-id "n$n" --listen "127.0.0.1:$port" \
        --data-dir "$work/n$n" --no-network --pool-size 1 --lease-ttl-secs 3 >"$work/n$n.log" 2>&1 &
    pids+=($!)
done
gw=$(free_port)
"$bin" serve --role gateway --listen "127.0.0.1:$gw" >"$work/gw.log" 2>&1 &
pids+=($!)
export SANDFORK_API_URL=http://127.0.0.1:$gw

start=$SECONDS
for port in "${ports[@]}" "$gw"; do
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
        ((SECONDS - start < 800)) || { tail -n 30 "$work"/*.log >&2; die "no /health on $port"; }
        sleep 1
    done
done
log "etcd, 2 nodes and the gateway up in $((SECONDS - start)) s"
registered=$(ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" get --prefix --keys-only /sandfork/v1/nodes/ | grep -c . || true)
[[ $registered == 2 ]] || die "nodes registered: $registered, expected 2"

# Two creates: placement by free capacity puts them on different nodes.
a=$("$bin" create) || die "create through the gateway"
# The node writes its new load asynchronously (and gateways keep no
# in-flight tally yet): give it a moment to land before the next create.
sleep 2
b=$("$bin" create) || die "second create through the gateway"
log "created $a and $b"
owner() { ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" get --print-value-only "/sandfork/v1/sandboxes/$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["node_id"])'; }
oa=$(owner "$a") ob=$(owner "$b")
log "$a on $oa, $b on $ob"
[[ $oa != "$ob" ]] || die "both sandboxes on $oa"
for id in "$a" "$b"; do
    out=$("$bin" exec "$id" -- echo "hello from $id") || die "exec in $id"
    [[ $out == "hello from $id" ]] || die "exec in $id printed '$out'"
done
listed=$("$bin" ls)
grep -q "$a" <<<"$listed" || die "ls through the gateway lacks $a: $listed"
grep -q "$b" <<<"$listed" || die "ls through the gateway lacks $b: $listed"
"$bin" rm "$a" || die "kill $a"
"$bin" rm "$b" || die "kill $b"
[[ -z $(ETCDCTL_API=3 etcdctl --endpoints="$SANDFORK_ETCD" get --prefix --keys-only /sandfork/v1/sandboxes/) ]] ||
    die "records left after the kills"
listed=$("$bin" ls)
! grep -q "$a" <<<"$listed" || die "$a still listed after its kill"
log "PASS: create, exec, ls and kill through the gateway on 2 nodes"
