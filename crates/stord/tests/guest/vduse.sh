# VDUSE: the daemon named by stord.daemon= runs in the guest and serves a null node and a
# file node as VDUSE devices, attached with iproute2's vdpa tool. Each step prints a
# GUEST-<key> line; the host compares them between stord and qsd.
d=$(sed -n 's/.*stord\.daemon=\([^ ]*\).*/\1/p' /proc/cmdline)
set -e
zero1m=$(dd if=/dev/zero bs=1M count=1 2>/dev/null | sha256sum | cut -d' ' -f1)
dd if=/dev/zero of=/tmp/disk.img bs=1M count=64 2>/dev/null
mkfifo /tmp/qmp.in
exec 4<>/tmp/qmp.in
start() {
    "$d" --blockdev null-co,node-name=n0,size=67108864,read-zeroes=on \
        --blockdev file,node-name=f0,filename=/tmp/disk.img,discard=unmap \
        --export vduse-blk,id=e0,node-name=n0,name=vd0 \
        --export vduse-blk,id=e1,node-name=f0,name=vd1,writable=on,num-queues=2 \
        --chardev stdio,id=m --monitor chardev=m <&4 >>/tmp/qmp.out 2>>/tmp/daemon.err &
    pid=$!
    echo '{"execute":"qmp_capabilities"}' >&4
    for i in $(seq 100); do [ -e /dev/vduse/vd1 ] && break; sleep 0.1; done
}
# The block device of vDPA device $1.
blk() { ls /sys/bus/vdpa/devices/$1/virtio*/block/ 2>/dev/null; }
start
echo "GUEST-CREATED $(ls /dev/vduse | tr '\n' ' ')"
vdpa dev add name vd0 mgmtdev vduse
vdpa dev add name vd1 mgmtdev vduse
for i in $(seq 50); do [ -n "$(blk vd1)" ] && [ -n "$(blk vd0)" ] && break; sleep 0.1; done
n=/dev/$(blk vd0)
f=/dev/$(blk vd1)
fb=$(blk vd1)
echo "GUEST-NULL $(cat /sys/block/$(blk vd0)/size) ro=$(cat /sys/block/$(blk vd0)/ro)"
[ "$(dd if=$n bs=1M count=1 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)" = "$zero1m" ] &&
    echo "GUEST-NULL-READ zeroes"
dd if=/dev/zero of=$n bs=4k count=1 oflag=direct 2>/dev/null && echo "GUEST-NULL-WRITE done" ||
    echo "GUEST-NULL-WRITE refused"
echo "GUEST-FILE $(cat /sys/block/$fb/size) ro=$(cat /sys/block/$fb/ro) queues=$(ls /sys/block/$fb/mq | wc -l)"
echo "GUEST-LIMITS discard=$(cat /sys/block/$fb/queue/discard_max_bytes) zeroes=$(cat /sys/block/$fb/queue/write_zeroes_max_bytes)"
# A pattern at 1 MiB, flushed, read back through the device and found in the file.
dd if=/dev/urandom of=/tmp/p bs=1M count=4 2>/dev/null
dd if=/tmp/p of=$f bs=64k seek=16 oflag=direct 2>/dev/null
sync $f
echo 3 > /proc/sys/vm/drop_caches
[ "$(dd if=$f bs=64k skip=16 count=64 iflag=direct 2>/dev/null | sha256sum)" = "$(sha256sum < /tmp/p)" ] &&
    echo "GUEST-READBACK same"
[ "$(dd if=/tmp/disk.img bs=64k skip=16 count=64 2>/dev/null | sha256sum)" = "$(sha256sum < /tmp/p)" ] &&
    echo "GUEST-IN-FILE same"
# Discard 1-2 MiB and write zeroes over 2-3 MiB (util-linux's blkdiscard: busybox's
# applet, which its shell prefers, has no -z): both read back as zeroes.
blkdiscard -o $((1 << 20)) -l $((1 << 20)) $f
[ "$(dd if=$f bs=1M skip=1 count=1 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)" = "$zero1m" ] &&
    echo "GUEST-DISCARDED zeroes"
/usr/sbin/blkdiscard -z -o $((2 << 20)) -l $((1 << 20)) $f
[ "$(dd if=/tmp/disk.img bs=1M skip=2 count=1 2>/dev/null | sha256sum | cut -d' ' -f1)" = "$zero1m" ] &&
    echo "GUEST-ZEROED zeroes"
# The daemon dies and a new one takes the devices over: the rest of the pattern reads back.
kill -9 $pid
wait $pid || true
start
want=$(dd if=/tmp/p bs=1M skip=2 count=2 2>/dev/null | sha256sum)
[ "$(dd if=$f bs=1M skip=3 count=2 iflag=direct 2>/dev/null | sha256sum)" = "$want" ] &&
    echo "GUEST-RECONNECTED same"
# Killed again with writes in flight: the next daemon replays what the last one took and
# did not complete (its in-flight log), so the writer finishes and the data is all there.
dd if=/dev/urandom of=/tmp/q bs=1M count=24 2>/dev/null
dd if=/tmp/q of=$f bs=4k seek=2048 oflag=direct 2>/dev/null &
w=$!
sleep 0.3
kill -0 $w 2>/dev/null && echo "GUEST-INFO writing when killed"
kill -9 $pid
wait $pid || true
start
for i in $(seq 600); do kill -0 $w 2>/dev/null || break; sleep 0.1; done
if kill -0 $w 2>/dev/null; then echo "GUEST-WRITER hung"; kill $w; else
    wait $w && echo "GUEST-WRITER done"
fi
[ "$(dd if=$f bs=64k skip=128 count=384 iflag=direct 2>/dev/null | sha256sum)" = "$(sha256sum < /tmp/q)" ] &&
    echo "GUEST-REPLAYED same"
# The export goes while the device is open: the command succeeds, the other export serves
# on, and the device can then be detached.
exec 3<$f
echo '{"execute":"block-export-del","arguments":{"id":"e1"}}' >&4
for i in $(seq 100); do grep -q BLOCK_EXPORT_DELETED /tmp/qmp.out && break; sleep 0.1; done
grep -q BLOCK_EXPORT_DELETED /tmp/qmp.out && echo "GUEST-EXPORT-DELETED e1"
[ "$(dd if=$n bs=1M count=1 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)" = "$zero1m" ] &&
    echo "GUEST-OTHER-SERVED zeroes"
exec 3<&-
echo 1 > /sys/class/vduse/vd1/msg_timeout
vdpa dev del vd1 || true
[ -z "$(ls /sys/block | grep "^$fb\$")" ] && echo "GUEST-DETACHED $fb"
# Detached while served, then the daemon stops (each step bounded, so a hang shows as
# such instead of stalling the guest).
timeout 30 vdpa dev del vd0 && echo "GUEST-DETACHED-SERVED vd0" || echo "GUEST-DETACHED-SERVED timeout"
kill $pid
for i in $(seq 300); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
if kill -0 $pid 2>/dev/null; then
    echo "GUEST-EXIT hung"
    kill -9 $pid
else
    wait $pid && echo "GUEST-EXIT 0" || echo "GUEST-EXIT $?"
fi
echo "GUEST-LEFT $(ls /dev/vduse | tr '\n' ' ')"
echo "GUEST-STDERR $(wc -c < /tmp/daemon.err)"
cat /tmp/daemon.err
