#!/bin/bash
# One 5 s fio run (nbd engine, 4k random reads, QD16) against BINARY serving a null-co node
# over NBD on one IoThread (THREADS=2: two IoThreads, two fio jobs). Prints the IOPS.
# Two builds side by side: alternate calls, e.g.
#   for r in 1 2 3; do scripts/bench-nbd-null-randread.sh OLD; scripts/bench-nbd-null-randread.sh NEW; done
#   usage: scripts/bench-nbd-null-randread.sh BINARY
set -eu
BIN=$1; THREADS=${THREADS:-1}; D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
S=$D/nbd.sock
threads=(--object iothread,id=io0); placement="iothread.0=io0"
if [ "$THREADS" = 2 ]; then
  threads+=(--object iothread,id=io1); placement="iothread.0=io0,iothread.1=io1"
fi
"$BIN" "${threads[@]}" --blockdev driver=null-co,node-name=n,size=1G \
  --nbd-server addr.type=unix,addr.path=$S --export type=nbd,id=e,node-name=n,name=n,$placement \
  --pidfile $D/pid 2>$D/err &
for i in $(seq 100); do [ -e $D/pid ] && break; sleep 0.05; done
fio --ioengine=nbd --uri="nbd+unix:///n?socket=$S" --rw=randread --bs=4k --iodepth=16 --numjobs=$THREADS --group_reporting \
  --runtime=5 --time_based --name=x --output-format=json --verify_state_save=0 > $D/fio.json 2>$D/fio.err
kill $(cat $D/pid); wait
python3 -c "import json;t=open('$D/fio.json').read();j=json.loads(t[t.index('{'):]);print(round(j['jobs'][0]['read']['iops']))"
