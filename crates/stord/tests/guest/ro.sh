# Read-only export: the guest sees a read-only disk and a write fails.
echo "GUEST-RO $(cat /sys/block/vda/ro)"
dd if=/dev/vda of=/tmp/r bs=64k skip=16 count=64 iflag=direct 2>/dev/null || exit 1
echo "GUEST-READ $(sha256sum /tmp/r | cut -d' ' -f1)"
if dd if=/dev/zero of=/dev/vda bs=4k count=1 oflag=direct 2>/dev/null; then
    echo "GUEST-WRITE succeeded"; exit 1
fi
echo "GUEST-WRITE refused"
[ "$(cat /sys/block/vda/ro)" = 1 ]
