#!/usr/bin/env bash
# A whole job as separate processes on this machine: an etcd on a free port
# with a temporary data directory, certificates for the job, one master,
# P pservers and T trainers, each its own process, coordinated through etcd
# and talking QUIC with mutual TLS on 127.0.0.1. Prints the master's output
# (one line per pass, then the job's JSON report) and `status` at the end.
#
#   scripts/local-cluster.sh                      # a1a, 2 pservers, 3 trainers
#   PSERVERS=3 TRAINERS=4 scripts/local-cluster.sh --passes 3 --mode async
#
# Extra arguments go to the master (the job's options). Needs etcd
# (apt-get install -y etcd-server) and protoc to build (protobuf-compiler).
set -euo pipefail
cd "$(dirname "$0")/.."

PSERVERS=${PSERVERS:-2}
TRAINERS=${TRAINERS:-3}
JOB=${JOB:-local-cluster}

work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

cargo build --release --features etcd --example master --example pserver --example trainer \
    --example certs --example status
# Where cargo put them: CARGO_TARGET_DIR if set (relative to the repository, as cargo takes it).
bin=${CARGO_TARGET_DIR:-target}/release/examples

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
client_port=$(free_port)
peer_port=$(free_port)
etcd_url="http://127.0.0.1:$client_port"
etcd --name oar-local --data-dir "$work/etcd" \
    --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "oar-local=http://127.0.0.1:$peer_port" \
    --auto-compaction-mode revision --auto-compaction-retention 1000 \
    --log-level error >"$work/etcd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$client_port") 2>/dev/null && break
    sleep 0.1
done

"$bin/certs" "$work/certs" master pserver trainer >/dev/null
conn() { echo --etcd "$etcd_url" --job "$JOB" --ca "$work/certs/ca.pem" --cert "$work/certs/$1.pem" --key "$work/certs/$1.key"; }

for i in $(seq "$PSERVERS"); do
    "$bin/pserver" $(conn pserver) --checkpoint-dir "$work/checkpoints" --checkpoint-interval 5 \
        >"$work/pserver-$i.log" 2>&1 &
    pids+=($!)
done
for i in $(seq "$TRAINERS"); do
    "$bin/trainer" $(conn trainer) --id "trainer-$i" >"$work/trainer-$i.log" 2>&1 &
    pids+=($!)
done
status=0
"$bin/master" $(conn master) --data testdata/a1a --test-data testdata/a1a.t --features 123 --classes 2 \
    --pservers "$PSERVERS" "$@" || status=$?
"$bin/status" --etcd "$etcd_url" --job "$JOB" || true
exit "$status"
