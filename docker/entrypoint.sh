#!/bin/sh
# Entry point of the rlstream image (under tini, so Ray's daemons are reaped and signals reach us).
#
#   entrypoint.sh ray-head [RAY START FLAGS...]
#       Start the Ray head in this container (non-blocking), then host TransferQueue on it with
#       tq_host.py, which stays in the foreground. Under KubeRay (annotation
#       ray.io/overwrite-container-cmd: "true") the flags come from KubeRay's generated command in
#       $KUBERAY_GEN_RAY_START_CMD, run without its --block.
#   entrypoint.sh RLSTREAM ARGS...
#       `rlstream ARGS`. With $RAY_HEAD_ADDRESS set, first join that Ray cluster with a local raylet
#       (ray.init(address=...) needs one on the same node) offering no CPU, so no actor and no TQ
#       storage unit is ever placed on this container. For `reassemble`, the worker id defaults to
#       the host name, stable across restarts of the same container or pod, so a restarted worker
#       fences its predecessor's transactions at once.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
ready_file=/tmp/rlstream-tq-ready

if [ "${1:-}" = ray-head ]; then
  shift
  rm -f "$ready_file"  # a restarted container keeps its /tmp: TQ is not up until tq_host says so
  if [ -n "${KUBERAY_GEN_RAY_START_CMD:-}" ]; then
    ulimit -n "${RAY_START_ULIMIT_OPEN_FILES:-65536}" 2>/dev/null || true
    eval "$(printf '%s' "$KUBERAY_GEN_RAY_START_CMD" | sed 's/ --block\( \|$\)/ /g')"
  else
    ray start --head --disable-usage-stats "$@"
  fi
  exec python "$here/tq_host.py" --ready-file "$ready_file"
fi

if [ -n "${RAY_HEAD_ADDRESS:-}" ]; then
  ray start --address="$RAY_HEAD_ADDRESS" --num-cpus=0 --disable-usage-stats
fi
if [ "${1:-}" = reassemble ] && [ -z "${RLSTREAM_REASSEMBLER_WORKER_ID:-}" ]; then
  RLSTREAM_REASSEMBLER_WORKER_ID=$(hostname)
  export RLSTREAM_REASSEMBLER_WORKER_ID
fi
exec rlstream "$@"
