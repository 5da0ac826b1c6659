#!/usr/bin/env bash
# A real S3-compatible server for the object-storage tests: Garage 2.5,
# single node on 127.0.0.1, SQLite metadata, replication_factor = 1.
#
#   scripts/garage.sh install   build garage with `cargo install` (reused when
#                               the cargo bin dir already has 2.5.0)
#   scripts/garage.sh start     start a server in target/garage, make a bucket
#                               and a key, write target/garage/env (the AWS_*
#                               variables the tests read)
#   scripts/garage.sh stop      stop that server
#   scripts/garage.sh cluster-start
#                               three nodes on 127.0.0.1 (replication factor 3,
#                               one layout, a zone each) in target/garage-cluster,
#                               S3 on node 1 (port 3910); target/garage-cluster/env
#                               has the AWS_* variables and where the nodes are
#                               (CKPT_CLUSTER_*), for the tests that kill and
#                               restart nodes
#   scripts/garage.sh cluster-stop
#
# Building takes 10-25 minutes on 2 cores; only the features the tests need
# (SQLite metadata, bundled C libraries) are built.
set -euo pipefail
cd "$(dirname "$0")/.."

GARAGE_VERSION=2.5.0
CARGO_BIN="${CARGO_HOME:-$HOME/.cargo}/bin"
GARAGE="$CARGO_BIN/garage"
DIR="$PWD/target/garage"
BUCKET=ckptstore-test
S3_PORT="${GARAGE_S3_PORT:-3900}"
RPC_PORT="${GARAGE_RPC_PORT:-3901}"
ADMIN_PORT="${GARAGE_ADMIN_PORT:-3903}"

installed() {
    [ -x "$GARAGE" ] && "$GARAGE" --version 2>/dev/null | grep -q ":$GARAGE_VERSION "
}

install() {
    if installed; then
        echo "garage $GARAGE_VERSION: already in $CARGO_BIN"
        return
    fi
    echo "garage $GARAGE_VERSION: cargo install (10-25 minutes on 2 cores)"
    cargo install garage --version "$GARAGE_VERSION" --locked \
        --no-default-features --features bundled-libs,sqlite
}

cli() {
    "$GARAGE" -c "$DIR/garage.toml" "$@"
}

start() {
    installed || { echo "garage $GARAGE_VERSION is not installed: run $0 install" >&2; exit 1; }
    stop >/dev/null 2>&1 || true
    rm -rf "$DIR"
    mkdir -p "$DIR/meta" "$DIR/data"
    cat >"$DIR/garage.toml" <<EOF
metadata_dir = "$DIR/meta"
data_dir = "$DIR/data"
db_engine = "sqlite"
replication_factor = 1
rpc_bind_addr = "127.0.0.1:$RPC_PORT"
rpc_public_addr = "127.0.0.1:$RPC_PORT"
rpc_secret = "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"

[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:$S3_PORT"
root_domain = ".s3.garage.localhost"

[admin]
api_bind_addr = "127.0.0.1:$ADMIN_PORT"
EOF
    nohup "$GARAGE" -c "$DIR/garage.toml" server >"$DIR/server.log" 2>&1 &
    echo $! >"$DIR/pid"
    for _ in $(seq 1 100); do
        cli status >/dev/null 2>&1 && break
        sleep 0.2
    done
    local node
    node=$(cli node id -q 2>/dev/null | cut -d@ -f1)
    cli layout assign -z dc1 -c 1G "$node" >/dev/null
    cli layout apply --version 1 >/dev/null
    cli bucket create "$BUCKET" >/dev/null
    local key
    key=$(cli key create ckptstore-key)
    local id secret
    id=$(echo "$key" | awk '/Key ID/ {print $NF}')
    secret=$(echo "$key" | awk '/Secret key/ {print $NF}')
    cli bucket allow --read --write --owner "$BUCKET" --key ckptstore-key >/dev/null
    cat >"$DIR/env" <<EOF
export AWS_ACCESS_KEY_ID=$id
export AWS_SECRET_ACCESS_KEY=$secret
export AWS_REGION=garage
export AWS_DEFAULT_REGION=garage
export AWS_ENDPOINT_URL=http://127.0.0.1:$S3_PORT
export AWS_ALLOW_HTTP=true
export CKPT_TEST_BUCKET=$BUCKET
export CKPT_GARAGE=$GARAGE
export CKPT_GARAGE_CONFIG=$DIR/garage.toml
export CKPT_GARAGE_PID=$DIR/pid
EOF
    echo "garage: serving s3://$BUCKET on 127.0.0.1:$S3_PORT (variables in $DIR/env)"
}

stop() {
    if [ -f "$DIR/pid" ]; then
        kill "$(cat "$DIR/pid")" 2>/dev/null || true
        rm -f "$DIR/pid"
    fi
}

CLUSTER="$PWD/target/garage-cluster"

# Node N of the cluster: S3 on 39N0, RPC on 39N1, admin on 39N3.
node_config() {
    local n=$1 secret=$2
    mkdir -p "$CLUSTER/n$n/meta" "$CLUSTER/n$n/data"
    cat >"$CLUSTER/n$n/garage.toml" <<EOF
metadata_dir = "$CLUSTER/n$n/meta"
data_dir = "$CLUSTER/n$n/data"
db_engine = "sqlite"
replication_factor = 3
rpc_bind_addr = "127.0.0.1:39${n}1"
rpc_public_addr = "127.0.0.1:39${n}1"
rpc_secret = "$secret"

[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:39${n}0"
root_domain = ".s3.garage.localhost"

[admin]
api_bind_addr = "127.0.0.1:39${n}3"
EOF
}

node_start() {
    local n=$1
    nohup "$GARAGE" -c "$CLUSTER/n$n/garage.toml" server >>"$CLUSTER/n$n/server.log" 2>&1 &
    echo $! >"$CLUSTER/n$n/pid"
}

ncli() {
    local n=$1
    shift
    "$GARAGE" -c "$CLUSTER/n$n/garage.toml" "$@"
}

cluster_start() {
    installed || { echo "garage $GARAGE_VERSION is not installed: run $0 install" >&2; exit 1; }
    cluster_stop >/dev/null 2>&1 || true
    rm -rf "$CLUSTER"
    local secret
    secret=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
    for n in 1 2 3; do
        node_config "$n" "$secret"
        node_start "$n"
    done
    local ids=()
    for n in 1 2 3; do
        for _ in $(seq 1 100); do
            ncli "$n" status >/dev/null 2>&1 && break
            sleep 0.2
        done
        ids[n]=$(ncli "$n" node id -q 2>/dev/null | cut -d@ -f1)
    done
    ncli 1 node connect "${ids[2]}@127.0.0.1:3921" >/dev/null
    ncli 1 node connect "${ids[3]}@127.0.0.1:3931" >/dev/null
    for n in 1 2 3; do
        ncli 1 layout assign -z "dc$n" -c 1G "${ids[n]}" >/dev/null
    done
    ncli 1 layout apply --version 1 >/dev/null
    # Every node sees the layout before the bucket is made.
    for n in 2 3; do
        for _ in $(seq 1 100); do
            ncli "$n" layout show 2>/dev/null | grep -q "version: 1" && break
            sleep 0.2
        done
    done
    ncli 1 bucket create "$BUCKET" >/dev/null
    local key id secret_key
    key=$(ncli 1 key create ckptstore-key)
    id=$(echo "$key" | awk '/Key ID/ {print $NF}')
    secret_key=$(echo "$key" | awk '/Secret key/ {print $NF}')
    ncli 1 bucket allow --read --write --owner "$BUCKET" --key ckptstore-key >/dev/null
    cat >"$CLUSTER/env" <<EOF
export AWS_ACCESS_KEY_ID=$id
export AWS_SECRET_ACCESS_KEY=$secret_key
export AWS_REGION=garage
export AWS_DEFAULT_REGION=garage
export AWS_ENDPOINT_URL=http://127.0.0.1:3910
export AWS_ALLOW_HTTP=true
export CKPT_CLUSTER_BUCKET=$BUCKET
export CKPT_CLUSTER_GARAGE=$GARAGE
export CKPT_CLUSTER_DIR=$CLUSTER
EOF
    echo "garage cluster: 3 nodes, s3://$BUCKET on 127.0.0.1:3910 (variables in $CLUSTER/env)"
}

cluster_stop() {
    for n in 1 2 3; do
        if [ -f "$CLUSTER/n$n/pid" ]; then
            kill "$(cat "$CLUSTER/n$n/pid")" 2>/dev/null || true
            rm -f "$CLUSTER/n$n/pid"
        fi
    done
}

case "${1:-}" in
install) install ;;
start) start ;;
stop) stop ;;
cluster-start) cluster_start ;;
cluster-stop) cluster_stop ;;
*)
    echo "usage: $0 install|start|stop|cluster-start|cluster-stop" >&2
    exit 2
    ;;
esac
