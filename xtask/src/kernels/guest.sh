#!/bin/bash
# The guest's script (`cargo xtask kernels`): PID 1 on the host's root, read-only over
# 9p, with no network device. Mounts what the tests need, loads the guest kernel's own
# modules, runs each line of the job file, and powers off. Each step's output and exit
# status go to the writable results folder the host reads.
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for d in /tmp /run /var; do mount -t tmpfs tmpfs $d; done
mount -t cgroup2 none /sys/fs/cgroup
mount -t bpf bpf /sys/fs/bpf
mount -t debugfs debugfs /sys/kernel/debug
arg() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" /proc/cmdline; }
out=/tmp/out
mkdir -p $out
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 out $out
kroot=$(arg kroot)
for m in veth sch_ingress cls_bpf 8021q bonding nf_conntrack_netlink; do
  modprobe -d "$kroot" $m 2>>$out/modules.log || echo "no module $m" >>$out/modules.log
done
ip link set lo up
export HOME=/tmp PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
cd "$(arg workdir)"
uname -r >$out/release
n=0
while IFS= read -r line; do
  n=$((n + 1))
  start=$(date +%s)
  bash -c "$line" >$out/$n.log 2>&1 </dev/null
  echo "$? $(( $(date +%s) - start ))" >$out/$n.status
done <"$(arg job)"
sync
echo o >/proc/sysrq-trigger
sleep 60
