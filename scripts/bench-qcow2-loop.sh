#!/bin/bash
# 4k random reads at QD16 from an allocated qcow2 image on a loop device with direct I/O
# over a tmpfs file (a fast block device without disk noise): stord vs qsd, fio's nbd
# engine, 5 s x 3 alternating, IOPS and daemon CPU per I/O. Needs root (mount, losetup).
set -euo pipefail
S=$(realpath "${STORD:-$(dirname "$0")/../target/release/stord}")
RUNTIME=${RUNTIME:-5}
work=$(mktemp -d)
mnt=$work/tmpfs
mkdir -p "$mnt"
mount -t tmpfs -o size=1200M tmpfs "$mnt"
truncate -s 1100M "$mnt/backing"
loop=$(losetup --direct-io=on --show -f "$mnt/backing")
cleanup() { losetup -d "$loop" 2>/dev/null || true; umount "$mnt" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
# Every cluster allocated: 1 GiB of random data converted onto the device.
head -c 1G /dev/urandom > "$work/data.raw"
qemu-img create -q -f qcow2 "$loop" 1G
qemu-img convert -n -O qcow2 "$work/data.raw" "$loop"
rm "$work/data.raw"
ticks=$(getconf CLK_TCK)
for rep in 1 2 3; do
    for d in stord qsd; do
        rm -f "$work/n.sock" "$work/pid"
        if [ $d = stord ]; then P=$S; else P=qemu-storage-daemon; fi
        $P --object iothread,id=io0 \
           --blockdev "driver=qcow2,node-name=disk,read-only=on,file.driver=host_device,file.filename=$loop,file.aio=io_uring,file.cache.direct=on" \
           --nbd-server "addr.type=unix,addr.path=$work/n.sock" \
           --export type=nbd,id=e,node-name=disk,name=disk,iothread=io0 \
           --pidfile "$work/pid" 2>/dev/null &
        while [ ! -e "$work/pid" ]; do sleep 0.05; done
        pid=$(cat "$work/pid")
        cpu0=$(awk '{print $14+$15}' /proc/$pid/stat)
        iops=$(fio --name=r --ioengine=nbd --uri="nbd+unix:///disk?socket=$work/n.sock" \
            --rw=randread --bs=4k --iodepth=16 --runtime=$RUNTIME --time_based --size=1G \
            --verify_state_save=0 --output-format=json 2>/dev/null |
            sed -n '/^{/,$p' | python3 -c "import json,sys;print(round(json.load(sys.stdin)['jobs'][0]['read']['iops']))")
        cpu1=$(awk '{print $14+$15}' /proc/$pid/stat)
        kill $pid; wait
        us=$(python3 -c "print(round(($cpu1-$cpu0)/$ticks*1e6/($iops*$RUNTIME),1))")
        echo "rep $rep $d iops $iops cpu_us_per_io $us"
    done
done
