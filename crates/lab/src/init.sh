#!/bin/busybox sh
# PID 1 of the sandfork lab machine. Loads the modules (so /dev/kvm exists),
# mounts the host's root shared over 9p, and runs the job the host left in
# the directory named by `sandfork.job=` on the kernel command line, chrooted
# into the host root. The command's stdout and stderr go to their own
# virtio-serial ports; its exit status goes to a third port as a marker line.
/bin/busybox mkdir -p /bin /proc /sys /dev /host /job
/bin/busybox --install -s /bin
export PATH=/bin

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

say() { echo "sandfork-lab init: $*" >/dev/console; }
status=
fail() {
    say "$*"
    [ -n "$status" ] && echo "SANDFORK-ERROR $*" >&3
    sync
    poweroff -f
}

# A module's parameters from the kernel command line (`kvm_amd.vgif=0`), as
# modprobe passes them: insmod alone does not read the command line.
read -r cmdline </proc/cmdline
params() {
    name=$(echo "${1%.ko}" | tr - _)
    for a in $cmdline; do
        case "$a" in "$name".*=*) echo "${a#"$name".}" ;; esac
    done
}
while read -r m; do
    # shellcheck disable=SC2046 # one word per parameter
    insmod "/lib/modules/$m" $(params "$m") || say "insmod $m failed"
done </lib/modules/order

# Ports appear asynchronously once the host has announced them.
port() {
    for p in /sys/class/virtio-ports/*; do
        [ "$(cat "$p/name" 2>/dev/null)" = "$1" ] && { echo "/dev/${p##*/}"; return 0; }
    done
    return 1
}
i=0
while :; do
    out=$(port sandfork.stdout) && err=$(port sandfork.stderr) &&
        status=$(port sandfork.status) && diag=$(port sandfork.diag) &&
        [ -e "$out" ] && [ -e "$err" ] && [ -e "$status" ] && [ -e "$diag" ] && break
    status=
    i=$((i + 1))
    [ $i -gt 400 ] && fail "virtio-serial ports did not appear"
    sleep 0.05
done
exec 3>"$status"
# The host tells a machine that stands still from a slow one by these beats
# (crates/lab/src/stall.rs); one short line per write keeps them whole
# beside the exit status on the same port.
(while sleep 2; do echo SANDFORK-BEAT >&3; done) &

# The machine's state, asked for by the host when the command overruns its
# timeout: the kernel's messages (nested KVM reports there), memory, and
# every thread with its state and the kernel function it waits in.
diagnose() {
    echo "--- lab: load $(cat /proc/loadavg), uptime $(cut -d' ' -f1 /proc/uptime) s"
    grep -E '^(MemTotal|MemAvailable|Shmem):' /proc/meminfo | tr -s ' ' | tr '\n' ' '
    echo
    echo "--- lab kernel messages (tail)"
    dmesg | tail -n 150
    echo "--- lab threads (pid/tid, name, state, wait channel)"
    for t in /proc/[0-9]*/task/[0-9]*; do
        # Shell built-ins only: a fork per thread is slow under emulation.
        read -r stat <"$t/stat" 2>/dev/null || continue
        read -r comm <"$t/comm"
        wchan=
        read -r wchan <"$t/wchan"
        state=${stat##*) }
        echo "${t#/proc/} $comm ${state%% *} ${wchan:--}"
    done | grep -vE ' (kworker|ksoftirqd|migration|cpuhp|rcu_|idle_inject)' | head -n 300
}
(
    exec 4<>"$diag"
    echo SANDFORK-DIAG-READY >&4
    while read -r request <&4; do
        [ "$request" = diag ] && diagnose >&4 2>&1
        echo SANDFORK-DIAG-END >&4
    done
) &

# A machine that stood still (the emulator did not run it, or its kernel
# could not take a timer interrupt) says so in its kernel log, where every
# diagnostics report and `sandfork stress` look: a 5 s sleep that took over
# 20 s (a busy lab makes it take at most a second or two more).
(
    read -r up _ </proc/uptime
    last=${up%.*}
    while sleep 5; do
        read -r up _ </proc/uptime
        now=${up%.*}
        [ $((now - last)) -gt 20 ] &&
            echo "sandfork-lab: this machine stood still for about $((now - last - 5)) s" >/dev/kmsg
        last=$now
    done
) &

job=
for a in $cmdline; do
    case "$a" in
    sandfork.job=*) job=${a#sandfork.job=} ;;
    sandfork.root_cache=*) root_cache=${a#sandfork.root_cache=} ;;
    esac
done
[ -n "$job" ] || fail "no sandfork.job= on the kernel command line"

opts=trans=virtio,version=9p2000.L,msize=524288
mount -t 9p -o "$opts,ro,cache=${root_cache:-loose}" hostroot /host || fail "cannot mount the host root over 9p"
# Larger read-ahead makes big sequential reads through the page cache much faster.
for b in /sys/class/bdi/9p-*; do echo 16384 >"$b/read_ahead_kb"; done 2>/dev/null

# Copy the job in before /tmp is covered by a fresh tmpfs.
cp "/host$job/job.sh" "/host$job/mounts" /job/ || fail "cannot read the job in $job"

mount -t proc proc /host/proc || fail "cannot mount /proc in the host root"
mount -t sysfs sysfs /host/sys
# cgroup v2 for the node's per-VMM groups (the lab kernel has every controller).
mount -t cgroup2 cgroup2 /host/sys/fs/cgroup || fail "cannot mount cgroup2 in the host root"
mount -t devtmpfs devtmpfs /host/dev || fail "cannot mount /dev in the host root"
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /host/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /host/dev/shm
mount -t tmpfs -o mode=1777 tmpfs /host/tmp || fail "cannot mount /tmp in the host root"
mount -t tmpfs -o mode=755 tmpfs /host/run || fail "cannot mount /run in the host root"

# Read-write shares: "TAG PATH" per line.
while read -r tag path; do
    [ -n "$tag" ] || continue
    [ -d "/host$path" ] || mkdir -p "/host$path" || fail "no mount point for $path"
    mount -t 9p -o "$opts,cache=mmap" "$tag" "/host$path" || fail "cannot mount $path read-write"
done </job/mounts

mkdir -p /host/run/sandfork
cp /job/job.sh /host/run/sandfork/job.sh

hostname sandfork-lab
ip link set lo up
if ip link set eth0 up 2>/dev/null; then
    ip addr add 10.0.2.15/24 dev eth0
    ip route add default via 10.0.2.2
fi

# A node runs up to --max-sandboxes VMMs, each with a dozen descriptors: the
# kernel's default hard limit of 4096 open files would cap it (root may raise
# it to fs.nr_open).
ulimit -n "$(cat /proc/sys/fs/nr_open)" 2>/dev/null || say "cannot raise the open-files limit"
env -i /bin/chroot /host /bin/sh /run/sandfork/job.sh <"/dev/null" >"$out" 2>"$err"
code=$?
sync
echo "SANDFORK-EXIT $code" >&3
poweroff -f
