# Read-write export: O_DIRECT pattern write + read-back, both queues busy, discard.
set -e
echo "GUEST-SECTORS $(cat /sys/block/vda/size)"
echo "GUEST-QUEUES $(ls /sys/block/vda/mq | wc -l)"
echo "GUEST-LBS $(cat /sys/block/vda/queue/logical_block_size)"
dd if=/dev/urandom of=/tmp/p bs=1M count=4 2>/dev/null
echo "GUEST-WROTE $(sha256sum /tmp/p | cut -d' ' -f1)"
dd if=/tmp/p of=/dev/vda bs=64k seek=16 oflag=direct 2>/dev/null
echo 3 > /proc/sys/vm/drop_caches
dd if=/dev/vda of=/tmp/r bs=64k skip=16 count=64 iflag=direct 2>/dev/null
echo "GUEST-READ $(sha256sum /tmp/r | cut -d' ' -f1)"
# One reader pinned to each vCPU, so a multi-queue device sees requests on every queue.
for cpu in 0 1; do
    taskset -c $cpu dd if=/dev/vda of=/dev/null bs=4k count=2000 iflag=direct 2>/dev/null &
done
wait
echo "GUEST-PARALLEL ok"
blkdiscard -o $((8 << 20)) -l $((8 << 20)) /dev/vda
echo "GUEST-DISCARDED"
