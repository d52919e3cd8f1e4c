#!/bin/bash
# Builds the test guest for the vhost-user-blk and VDUSE tests: Debian's kernel (downloaded
# as a .deb and unpacked here, not installed on the host) and a busybox initramfs whose
# /init loads the virtio and VDUSE modules and runs the script named by `stord.script=` on
# the kernel command line (scripts are packed from crates/stord/tests/guest/).
#
#   scripts/build-guest.sh                     # target/guest/{vmlinuz,initrd}
#   scripts/build-guest.sh NAME BIN...         # also target/guest/initrd-NAME, carrying
#                                              # BIN... and the libraries they link
#
# The kernel is bookworm-backports' 6.12: bookworm's 6.1 has VDPA off, 6.12 ships vdpa,
# vduse and virtio_vdpa. Idempotent: rebuilds only the initramfs when the kernel is there.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/guest
mkdir -p "$out"
meta=linux-image-6.12-amd64
modules="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk vhost_iotlb vdpa vduse virtio_vdpa"
if [[ ! -s $out/vmlinuz || ! -s $out/modules/vduse.ko ]]; then
    resolve() { apt-cache depends "$meta" 2>/dev/null | sed -n 's/.*Depends: \(linux-image-[0-9].*\)/\1/p' | head -1; }
    pkg=$(resolve)
    [[ -n $pkg ]] || { apt-get update -qq; pkg=$(resolve); }
    [[ -n $pkg ]] || { echo "build-guest: cannot resolve $meta (bookworm-backports in the apt sources?)" >&2; exit 1; }
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    (cd "$work" && apt-get download -q "$pkg" >/dev/null 2>&1 || { apt-get update -qq && apt-get download -q "$pkg"; })
    dpkg-deb -x "$work"/*.deb "$work/root"
    cp "$work"/root/boot/vmlinuz-* "$out/vmlinuz"
    rm -rf "$out/modules" && mkdir -p "$out/modules"
    for m in $modules; do
        f=$(find "$work/root/lib/modules" -name "$m.ko*" | head -1)
        [[ -n $f ]] || continue # built in
        case $f in
            *.xz) xz -dc "$f" > "$out/modules/$m.ko" ;;
            *.zst) zstd -qdc "$f" > "$out/modules/$m.ko" ;;
            *) cp "$f" "$out/modules/$m.ko" ;;
        esac
    done
    rm -rf "$work"
    trap - EXIT
fi

name=${1:-}
[[ $# -gt 0 ]] && shift
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root"/{bin,sbin,proc,sys,dev,tmp,modules,scripts,run}
cp /bin/busybox "$root/bin/busybox"
for a in $("$root/bin/busybox" --list); do [[ $a == busybox ]] || ln -s busybox "$root/bin/$a"; done
cp "$out"/modules/*.ko "$root/modules/" 2>/dev/null || true
cp crates/stord/tests/guest/*.sh "$root/scripts/"
# Extra programs go to /usr/sbin (before busybox's applets in PATH) under their own names,
# stripped, with every library they link at the path the dynamic loader looks for it.
mkdir -p "$root/usr/sbin"
for bin in "$@"; do
    strip -o "$root/usr/sbin/$(basename "$bin")" "$bin" 2>/dev/null || cp "$bin" "$root/usr/sbin/"
    for lib in $(ldd "$bin" | grep -o '/[^ ]*'); do
        mkdir -p "$root$(dirname "$lib")"
        cp -L "$lib" "$root$lib"
    done
done
cat > "$root/init" <<INIT
#!/bin/sh
export PATH=/usr/sbin:/sbin:/bin:/usr/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
for m in $modules; do
    [ -f /modules/\$m.ko ] && insmod /modules/\$m.ko
done
script=\$(sed -n 's/.*stord\.script=\([^ ]*\).*/\1/p' /proc/cmdline)
echo "GUEST-START \$script"
# A vhost-user-blk disk is there from boot; a VDUSE script makes its own.
case \$script in vduse*) ;; *) for i in \$(seq 50); do [ -b /dev/vda ] && break; sleep 0.1; done ;; esac
if [ -n "\$script" ] && sh "/scripts/\$script.sh"; then echo "GUEST-PASS"; else echo "GUEST-FAIL"; fi
echo "GUEST-END"
sync
poweroff -f
INIT
chmod +x "$root/init"
initrd=$out/initrd${name:+-$name}
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$initrd.tmp"
mv "$initrd.tmp" "$initrd"
echo "build-guest: $out/vmlinuz $initrd"
