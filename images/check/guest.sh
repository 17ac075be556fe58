#!/bin/bash
# Runs as PID 1 (installed as the "agent", so /sbin/init -> this) inside a
# guest booted by images/check/boot.sh. Proves the kernel and the root
# filesystem give an agent what it needs, prints one line per check and a
# verdict, then waits for the host's Ctrl-Alt-Del (i8042 path) and falls
# back to a sysrq reboot.
echo "sandfork-check: init-reached"
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8

fails=0
check() {
    local name=$1
    shift
    local out
    if out=$("$@" 2>&1); then
        echo "sandfork-check: ok   $name ${out//$'\n'/ }"
    else
        echo "sandfork-check: FAIL $name ${out//$'\n'/ }"
        fails=$((fails + 1))
    fi
}

mount -t proc proc /proc 2>/dev/null
mount -t sysfs sysfs /sys
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mkdir -p /dev/pts /dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
# What the real agent does at start: the hostname comes from the image.
hostname -F /etc/hostname
echo "sandfork-check: mounted uptime=$(cut -d' ' -f1 /proc/uptime)"

check pid1 test $$ -eq 1
check devtmpfs test -b /dev/vda -a -c /dev/null -a -c /dev/ttyS0
check root-rw sh -c 'echo x >/var/tmp/rw && rm /var/tmp/rw && findmnt -no FSTYPE,OPTIONS /'
check cpus sh -c 'test "$(nproc)" -ge 2 && nproc'
check bash bash -c 'echo "bash $BASH_VERSION"'
check python3 python3 -c 'import sys, ssl, sqlite3; print(sys.version.split()[0], ssl.OPENSSL_VERSION)'
check tools sh -c 'git --version && curl --version | head -n1 && ps -p 1 -o comm= && ip -br link && pip --version'
check users sh -c 'id user && test "$(getent passwd user | cut -d: -f3,6)" = 1000:/home/user && test -z "$(getent shadow root | cut -d: -f2)"'
check sudo sh -c 'test "$(su user -s /bin/sh -c "sudo -n id -u")" = 0 && echo sudo-ok'
check cgroup2 sh -c 'mount -t cgroup2 cgroup2 /sys/fs/cgroup && for c in cpuset cpu io memory pids; do grep -qw $c /sys/fs/cgroup/cgroup.controllers || { echo "no $c"; exit 1; }; done; cat /sys/fs/cgroup/cgroup.controllers'
check cgroup-limit sh -c 'echo "+memory +pids" >/sys/fs/cgroup/cgroup.subtree_control && mkdir /sys/fs/cgroup/t && echo 64M >/sys/fs/cgroup/t/memory.max && echo 10 >/sys/fs/cgroup/t/pids.max && echo 0 >/sys/fs/cgroup/t/cgroup.freeze && rmdir /sys/fs/cgroup/t && echo limits-ok'
check overlay sh -c 'cd /tmp && mkdir -p l u w m && echo lower >l/f && mount -t overlay overlay -o lowerdir=l,upperdir=u,workdir=w m && echo upper >m/f && cat l/f u/f && umount m'
check fuse test -c /dev/fuse
check vsock python3 -c 'import socket; s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM); s.bind((socket.VMADDR_CID_ANY, 1024)); s.listen(); print("AF_VSOCK listen ok")'
check pty python3 -c 'import os, pty; pid, fd = pty.fork(); (os.execvp("tty", ["tty"]) if pid == 0 else None); print(os.read(fd, 100).decode().strip()); os.waitpid(pid, 0)'
check namespaces unshare --user --map-root-user --pid --net --uts --ipc --mount --fork sh -c 'hostname ns && echo "uid $(id -u) pid $$"'
check netdevs sh -c 'ip link set lo up && ip link add br0 type bridge && ip link add v0 type veth peer name v1 && ip link set v0 master br0 && ip tuntap add t0 mode tap && ip -br link | grep -c -e br0 -e v0 -e v1 -e t0'
check virtio-net sh -c 'ls /sys/class/net | grep -v -e lo -e br0 -e v0 -e v1 -e t0'
check virtio-rng cat /sys/class/misc/hw_random/rng_current
check entropy python3 -c 'import os; print(len(os.getrandom(32, os.GRND_NONBLOCK)), "random bytes")'
check io_uring python3 -c 'import ctypes; r = ctypes.CDLL(None).syscall(425, 4, ctypes.create_string_buffer(120)); print("io_uring fd", r); assert r >= 0'
check inotify python3 -c 'import ctypes; fd = ctypes.CDLL(None).inotify_init(); assert fd >= 0; print("inotify fd", fd)'
check sysrq cat /proc/sys/kernel/sysrq

echo "sandfork-check: uptime=$(cut -d' ' -f1 /proc/uptime)"
if ((fails == 0)); then
    echo "sandfork-check: PASS"
else
    echo "sandfork-check: FAIL $fails"
fi
sync
# The host answers the verdict with Ctrl-Alt-Del through the i8042; with
# the kernel's default (C_A_D on) that restarts, and QEMU -no-reboot exits.
sleep 30
echo "sandfork-check: no ctrl-alt-del, sysrq reboot"
echo 1 >/proc/sys/kernel/sysrq
echo b >/proc/sysrq-trigger
sleep 10
