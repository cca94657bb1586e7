#!/usr/bin/env bash
# Smoke test of a new cluster: run the same command on every node, e.g. with two hosts:
#   host A:  scripts/multinode_smoke.sh 2 0 HOST_A 29500
#   host B:  scripts/multinode_smoke.sh 2 1 HOST_A 29500
# Runs a fast tiny-dims check of every layer, one with a TP group per node (dp = nnodes, each
# group inside its node), then one flash-dims check, and prints a summary.
# Extra arguments are passed to every run (e.g. backend=nccl tp=16 nproc_per_node=8).
set -uo pipefail
if [ $# -lt 4 ]; then
  echo "usage: $0 NNODES NODE_RANK MASTER_ADDR MASTER_PORT [extra config keys...]" >&2
  exit 2
fi
nnodes=$1 node_rank=$2 addr=$3 port=$4
shift 4
python=${PYTHON:-python}
out=${SMOKE_DIR:-multinode-smoke}
tp=$((2 * nnodes))
declare -a names codes
i=0
check() {  # name, then config keys
  local name=$1
  shift
  # Each check gets its own port so that a node still closing the previous rendezvous never
  # meets the next one.
  "$python" -m launcher "$@" nnodes="$nnodes" node_rank="$node_rank" master_addr="$addr" \
    master_port=$((port + i)) hydra.run.dir="$out/$name/node$node_rank" "${extra[@]}"
  codes[i]=$?
  names[i]=$name
  i=$((i + 1))
}
extra=("$@")
for layer in swa csa hca; do
  check "tiny-$layer" layer=$layer model=tiny tp=$tp
done
check "tiny-dp" layer=swa model=tiny tp=2 dp="$nnodes"
check "flash-swa" layer=swa model=flash tp=$tp local_t=64

echo
echo "== multi-node smoke summary (node $node_rank of $nnodes, master $addr:$port) =="
status=0
for j in "${!names[@]}"; do
  case ${codes[j]} in
    0) verdict=PASS ;;
    1) verdict=FAIL; status=1 ;;
    *) verdict="ERROR (exit ${codes[j]})"; status=1 ;;
  esac
  printf '  %-12s %s\n' "${names[j]}" "$verdict"
done
exit $status
