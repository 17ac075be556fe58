#!/bin/sh
# Boots the static agent as PID 1 of a real Linux kernel under QEMU TCG (no KVM
# needed) and checks it from inside the guest: mounts, /dev links, hostname,
# loopback, HTTP on vsock (through the vsock_loopback transport), orphan reaping,
# then a clean shutdown that must end QEMU (-no-reboot).
#
#   boot-check.sh VMLINUZ MODULES_DIR AGENT {sigterm|cad}
#
# VMLINUZ/MODULES_DIR: a Debian cloud kernel (linux-image-*-cloud-amd64, unpacked
# with dpkg-deb -x) whose vsock modules are built as modules. AGENT: the static
# release binary. sigterm: the guest runs `kill -TERM 1`; cad: the host presses
# ctrl-alt-del through the QEMU monitor, which the agent must receive as SIGINT.
# Needs qemu-system-x86, busybox-static, socat, cpio.
set -eu
VMLINUZ=$1 MODULES=$2 AGENT=$3 MODE=$4
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
R=$W/root
mkdir -p $R/bin $R/etc $R/mod
cp /bin/busybox $R/bin/
for a in sh insmod sleep cat ls ps hostname ip printf echo kill grep mknod mkdir sed head; do
    ln -s busybox $R/bin/$a
done
cp /usr/bin/socat $R/bin/
for lib in $(ldd /usr/bin/socat | grep -o '/[^ ]*'); do
    mkdir -p $R$(dirname $lib) && cp -L $lib $R$lib
done
for m in vsock vmw_vsock_virtio_transport_common vsock_loopback; do
    cp $MODULES/kernel/net/vmw_vsock/$m.ko $R/mod/
done
cp $AGENT $R/sandfork-agent
echo lab-guest > $R/etc/hostname
# No /dev/console in the image on purpose: the agent must reopen the console.
cat > $R/init <<INIT
#!/bin/sh
export PATH=/bin
mkdir -p /dev && mknod /dev/null c 1 3
for m in vsock vmw_vsock_virtio_transport_common vsock_loopback; do insmod /mod/\$m.ko; done
(
  sleep 3
  exec >/dev/console 2>&1
  echo "PROBE pid1=\$(cat /proc/1/comm) hostname=\$(hostname)"
  grep -E ' (/proc|/sys|/dev|/dev/pts|/dev/shm|/tmp|/run|/sys/fs/cgroup) ' /proc/mounts | sed 's/^/PROBE mount /'
  echo "PROBE ptmx=\$(ls -l /dev/ptmx | head -c 1) fd=\$(ls -l /dev/fd | sed 's/.*-> //')"
  echo "PROBE lo \$(ip addr show lo | grep -o 'inet [0-9./]*')"
  for i in 1 2 3; do
    printf 'GET /health HTTP/1.1\r\nHost: g\r\n\r\n' | socat -t 5 - VSOCK-CONNECT:1:49983 | head -1 | sed 's/^/PROBE health /'
  done
  printf 'GET /nope HTTP/1.1\r\nHost: g\r\n\r\n' | socat -t 5 - VSOCK-CONNECT:1:49983 | head -1 | sed 's/^/PROBE unknown /'
  (sleep 1 &); (sleep 1 &); sleep 2
  echo "PROBE zombies=\$(ps -o stat | grep -c Z)"
  (sleep 1000 &)
  if [ $MODE = sigterm ]; then kill -TERM 1; fi
  sleep 1000
) &
exec /sandfork-agent stray-kernel-word
INIT
chmod +x $R/init
(cd $R && find . | cpio -o -H newc --quiet) | gzip -1 > $W/initrd.gz

LOG=$W/serial.log
start=$(date +%s)
qemu-system-x86_64 -accel tcg -cpu max -m 512 -smp 1 -kernel "$VMLINUZ" -initrd $W/initrd.gz \
    -append "console=ttyS0 panic=-1 quiet" -display none -serial file:$LOG -no-reboot \
    -monitor unix:$W/mon,server,nowait &
QEMU=$!
if [ $MODE = cad ]; then
    i=0
    until grep -q 'PROBE zombies' $LOG 2>/dev/null; do
        i=$((i + 1)); [ $i -lt 600 ] || break; sleep 0.2
    done
    echo 'sendkey ctrl-alt-delete' | socat - UNIX-CONNECT:$W/mon >/dev/null
fi
i=0
while kill -0 $QEMU 2>/dev/null; do
    i=$((i + 1))
    if [ $i -ge 600 ]; then kill $QEMU; echo "FAIL: QEMU still running after 120 s"; fi
    sleep 0.2
done
wait $QEMU || true
echo "QEMU ran $(( $(date +%s) - start )) s"
tr -d '\r' < $LOG | grep -E 'PROBE|sandfork-agent|reboot|panic'

fail=0
check() { grep -q -- "$1" $LOG || { echo "FAIL: no '$1'"; fail=1; }; }
check 'PROBE pid1=sandfork-agent hostname=lab-guest'
for m in /proc /sys /dev /dev/pts /dev/shm /tmp /run /sys/fs/cgroup; do check "PROBE mount [^ ]* $m "; done
check 'ptmxmode=666'
check 'PROBE lo inet 127.0.0.1/8'
[ "$(grep -c 'PROBE health HTTP/1.1 204 No Content' $LOG)" = 3 ] || { echo "FAIL: health"; fail=1; }
check 'PROBE unknown HTTP/1.1 404 Not Found'
check 'PROBE zombies=0'
if [ $MODE = cad ]; then check 'SIGINT: shutting down'; else check 'SIGTERM: shutting down'; fi
check 'unmounted'
check 'reboot: Restarting system'
if grep -q 'Kernel panic' $LOG; then echo "FAIL: kernel panic"; fail=1; fi
[ $fail = 0 ] && echo "PASS ($MODE)"
exit $fail
