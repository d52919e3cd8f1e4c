#!/bin/bash
# Builds the test guest for the vhost-user-blk tests: Debian's kernel (downloaded as a .deb
# and unpacked here, not installed on the host) and a busybox initramfs whose /init loads the
# virtio modules and runs the script named by `stord.script=` on the kernel command line
# (scripts are packed from crates/stord/tests/guest/). Output: target/guest/{vmlinuz,initrd}.
# Idempotent: rebuilds only the initramfs when the kernel is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/guest
mkdir -p "$out"
if [[ ! -s $out/vmlinuz || ! -d $out/modules ]]; then
    pkg=$(apt-cache depends linux-image-amd64 | sed -n 's/.*Depends: \(linux-image-[0-9].*\)/\1/p' | head -1)
    [[ -n $pkg ]] || { echo "build-guest: cannot resolve linux-image-amd64 (apt-get update?)" >&2; exit 1; }
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    (cd "$work" && apt-get download -q "$pkg" >/dev/null 2>&1 || { apt-get update -qq && apt-get download -q "$pkg"; })
    dpkg-deb -x "$work"/*.deb "$work/root"
    cp "$work"/root/boot/vmlinuz-* "$out/vmlinuz"
    rm -rf "$out/modules" && mkdir -p "$out/modules"
    for m in virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk; do
        f=$(find "$work/root/lib/modules" -name "$m.ko*" | head -1)
        [[ -n $f ]] || { echo "build-guest: module $m not in $pkg (built in?)"; continue; }
        case $f in
            *.xz) xz -dc "$f" > "$out/modules/$m.ko" ;;
            *.zst) zstd -qdc "$f" > "$out/modules/$m.ko" ;;
            *) cp "$f" "$out/modules/$m.ko" ;;
        esac
    done
fi

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root"/{bin,sbin,proc,sys,dev,tmp,modules,scripts}
cp /bin/busybox "$root/bin/busybox"
for a in $("$root/bin/busybox" --list); do [[ $a == busybox ]] || ln -s busybox "$root/bin/$a"; done
cp "$out"/modules/*.ko "$root/modules/" 2>/dev/null || true
cp crates/stord/tests/guest/*.sh "$root/scripts/"
cat > "$root/init" <<'INIT'
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
for m in virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk; do
    [ -f /modules/$m.ko ] && insmod /modules/$m.ko
done
script=$(sed -n 's/.*stord\.script=\([^ ]*\).*/\1/p' /proc/cmdline)
echo "GUEST-START $script"
for i in $(seq 50); do [ -b /dev/vda ] && break; sleep 0.1; done
if [ -n "$script" ] && sh "/scripts/$script.sh"; then echo "GUEST-PASS"; else echo "GUEST-FAIL"; fi
echo "GUEST-END"
sync
poweroff -f
INIT
chmod +x "$root/init"
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$out/initrd.tmp"
mv "$out/initrd.tmp" "$out/initrd"
echo "build-guest: $out/vmlinuz $out/initrd"
