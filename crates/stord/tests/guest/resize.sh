# Resize: the host grows the disk while the guest waits; the guest must see the new
# capacity without a reboot and use the space past the old end.
set -e
before=$(cat /sys/block/vda/size)
echo "GUEST-SECTORS $before"
echo "GUEST-RESIZE-NOW"
i=0
while [ "$(cat /sys/block/vda/size)" = "$before" ]; do
    i=$((i + 1))
    [ $i -le 300 ] || { echo "GUEST-NO-RESIZE"; exit 1; }
    sleep 0.1
done
echo "GUEST-SECTORS-AFTER $(cat /sys/block/vda/size)"
dd if=/dev/urandom of=/tmp/p bs=64k count=16 2>/dev/null
echo "GUEST-WROTE $(sha256sum /tmp/p | cut -d' ' -f1)"
dd if=/tmp/p of=/dev/vda bs=64k seek=1280 oflag=direct 2>/dev/null
echo 3 > /proc/sys/vm/drop_caches
dd if=/dev/vda of=/tmp/r bs=64k skip=1280 count=16 iflag=direct 2>/dev/null
echo "GUEST-READ $(sha256sum /tmp/r | cut -d' ' -f1)"
