#!/bin/bash
# Boot check for the guest kernel and root filesystem under QEMU's microvm
# machine (TCG: no usable KVM needed). Builds both (cached), with
# images/check/guest.sh as the agent, boots them the way sandfork's VMM
# does (vmlinux, virtio-mmio devices, serial console, MP table, no ACPI, no
# PCI), and fails unless every guest check passes and Ctrl-Alt-Del through
# the i8042 restarts the guest.
#
# Usage: images/check/boot.sh [--kernel VMLINUX] [--rootfs IMAGE] [--accel tcg|kvm]
# Out:   the serial console with host timestamps on stderr, a summary on
#        stdout; exit status 0 only if everything passed.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
images=$(dirname "$here")
kernel='' rootfs='' accel=tcg
while (($#)); do
    case $1 in
        --kernel) kernel=$2; shift 2 ;;
        --rootfs) rootfs=$2; shift 2 ;;
        --accel) accel=$2; shift 2 ;;
        *) echo "usage: $0 [--kernel VMLINUX] [--rootfs IMAGE] [--accel tcg|kvm]" >&2; exit 2 ;;
    esac
done
[[ -n $kernel ]] || kernel=$("$images/kernel/build.sh" | tail -n1)
[[ -n $rootfs ]] || rootfs=$("$images/rootfs/build.sh" --agent "$here/guest.sh" | tail -n1)

work=$(mktemp -d)
qemu_pid=''
cleanup() {
    [[ -z $qemu_pid ]] || kill "$qemu_pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
mkfifo "$work/console"

cmdline="console=ttyS0 reboot=k panic=1 pci=off nomodule i8042.noaux i8042.nomux i8042.dumbkbd root=/dev/vda rw"
# The kernel's log level is left verbose on purpose: the log is the evidence.
start=$EPOCHREALTIME
qemu-system-x86_64 -M microvm,acpi=off -accel "$accel" -cpu max -smp 2 -m 512 \
    -nographic -no-reboot -nodefaults -serial stdio -display none \
    -monitor "unix:$work/monitor,server=on,wait=off" \
    -device i8042 \
    -kernel "$kernel" -append "$cmdline" \
    -drive "id=root,file=$rootfs,format=raw,if=none,snapshot=on" \
    -device virtio-blk-device,drive=root \
    -netdev user,id=n0 -device virtio-net-device,netdev=n0 \
    -object rng-random,id=rng0,filename=/dev/urandom -device virtio-rng-device,rng=rng0 \
    </dev/null >"$work/console" 2>"$work/qemu.err" &
qemu_pid=$!

elapsed() { awk -v s="$start" -v n="$EPOCHREALTIME" 'BEGIN { printf "%.2f", n - s }'; }
init_at='' verdict='' cad=''
while IFS= read -r -t 600 line; do
    line=${line%$'\r'}
    printf '[%7ss] %s\n' "$(elapsed)" "$line" >&2
    case $line in
        "sandfork-check: init-reached"*) init_at=$(elapsed) ;;
        "sandfork-check: PASS" | "sandfork-check: FAIL "[0-9]*)
            verdict=${line#sandfork-check: }
            # Wait for the monitor's prompt, send, and wait for the next
            # prompt so the key is queued before the socket closes.
            python3 -c '
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect(sys.argv[1])
def prompt():
    buf = b""
    while not buf.endswith(b"(qemu) "):
        buf += s.recv(4096) or sys.exit("monitor closed")
prompt()
s.sendall(b"sendkey ctrl-alt-delete\n")
prompt()
' "$work/monitor"
            cad=sent ;;
        "sandfork-check: no ctrl-alt-del"*) cad=ignored ;;
    esac
done <"$work/console"
rc=0
wait "$qemu_pid" || rc=$?
qemu_pid=''
total=$(elapsed)
[[ -s $work/qemu.err ]] && sed 's/^/qemu: /' "$work/qemu.err" >&2

echo "kernel:       $kernel"
echo "rootfs:       $rootfs ($(du -h --apparent-size "$rootfs" | cut -f1) apparent, $(du -h "$rootfs" | cut -f1) on disk)"
echo "init reached: ${init_at:-never} s after QEMU start"
echo "checks:       ${verdict:-none}"
echo "ctrl-alt-del: ${cad:-not sent}"
echo "qemu exit:    $rc after $total s"
[[ $verdict == PASS && $cad == sent && $rc == 0 ]]
