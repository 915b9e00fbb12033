#!/usr/bin/env bash
# The command of supervisord's worldloop programs: deploy/run.sh ROLE INDEX [worldloop arguments...]
# runs `python -m worldloop ROLE ...` with
# - CUDA_VISIBLE_DEVICES = entry INDEX (modulo their number) of the space-separated list
#   WORLDLOOP_<ROLE>_GPUS from the env file: WORLDLOOP_ACTOR_GPUS="0 1 2 3" puts actor-00 on GPU 0,
#   actor-01 on GPU 1, ...; "0,1 2,3" gives each actor two. An empty list leaves it as it is.
# - redis.url = WORLDLOOP_REDIS_URL. The password (WORLDLOOP_REDIS_PASSWORD) stays in the environment,
#   where worldloop's Redis clients take it (common/transport/streams.py connect): it is on no command line.
set -euo pipefail
role=$1 index=$2
shift 2
var="WORLDLOOP_${role^^}_GPUS"
read -r -a gpus <<< "${!var:-}"
if [ ${#gpus[@]} -gt 0 ]; then
  export CUDA_VISIBLE_DEVICES="${gpus[$(( 10#$index % ${#gpus[@]} ))]}"
fi
exec "$WORLDLOOP_PYTHON" -m worldloop "$role" "$@" "redis.url=$WORLDLOOP_REDIS_URL"
