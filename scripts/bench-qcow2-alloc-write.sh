#!/bin/bash
# Sequential 1 MiB writes into an empty qcow2 through NBD: stord vs qsd, alternating.
S=$(realpath "${STORD:-$(dirname "$0")/../target/release/stord}")
cd "$(mktemp -d)"
for rep in 1 2 3; do
 for d in stord qsd; do
  rm -f img.qcow2 n.sock pid; qemu-img create -q -f qcow2 img.qcow2 4G
  if [ $d = stord ]; then P=$S; else P=qemu-storage-daemon; fi
  $P --blockdev driver=file,node-name=f,filename=$PWD/img.qcow2,cache.direct=on,aio=io_uring --blockdev driver=qcow2,node-name=q,file=f --nbd-server addr.type=unix,addr.path=$PWD/n.sock --export type=nbd,id=e,node-name=q,writable=on --pidfile $PWD/pid 2>/dev/null &
  while [ ! -e pid ]; do sleep 0.05; done
  bw=$(fio --name=w --ioengine=nbd --uri="nbd+unix:///q?socket=$PWD/n.sock" --rw=write --bs=1M --iodepth=4 --size=3G --runtime=5 --time_based=0 --output-format=json --verify_state_save=0 2>/dev/null | sed -n "/^{/,\$p" | python3 -c "import json,sys;d=json.load(sys.stdin);print(round(d['jobs'][0]['write']['bw']/1024))")
  kill $!; wait
  echo "$d rep$rep write MiB/s $bw"
 done
done
