# Sourced by deploy/supervisord.sh and deploy/ctl.sh: load the env file (deploy/worldloop.env or
# $WORLDLOOP_ENV_FILE), fill the defaults of optional variables, and name any required one missing.
set -a
. "${WORLDLOOP_ENV_FILE:-$here/worldloop.env}"
: "${WORLDLOOP_REDIS_PASSWORD:=}"             # empty: Redis without a password
: "${WORLDLOOP_LEARNER_GPUS:=}"               # empty: CUDA_VISIBLE_DEVICES left as it is
: "${WORLDLOOP_ACTOR_GPUS:=}"
: "${WORLDLOOP_JUDGE_GPUS:=}"
: "${WORLDLOOP_SERVE_GPUS:=}"
: "${WORLDLOOP_NUM_SERVERS:=0}"               # inference servers (actor.backend=server); 0 = none
: "${WORLDLOOP_SERVE_HOST:=127.0.0.1}"
: "${WORLDLOOP_SERVE_PORT_PREFIX:=97}"        # server-NN listens on port <prefix>NN
: "${WORLDLOOP_LEARNER_STOPWAITSECS:=600}"
: "${WORLDLOOP_HEAD_NODE:=true}"
: "${WORLDLOOP_SD_FILE:=$WORLDLOOP_RUN_DIR/prometheus-targets.json}"
: "${WORLDLOOP_SD_INTERVAL:=10}"
set +a
for _v in WORLDLOOP_HOME WORLDLOOP_PYTHON WORLDLOOP_CONFIG WORLDLOOP_RUN_DIR WORLDLOOP_LOG_DIR \
          WORLDLOOP_SUPERVISOR_DIR WORLDLOOP_REDIS_PORT WORLDLOOP_REDIS_BIND WORLDLOOP_REDIS_URL \
          WORLDLOOP_WEIGHTS_BIND WORLDLOOP_WEIGHTS_HOST WORLDLOOP_WEIGHTS_PUB_PORT WORLDLOOP_WEIGHTS_FETCH_PORT \
          WORLDLOOP_NUM_ACTORS WORLDLOOP_NUM_JUDGES WORLDLOOP_METRICS_HOST WORLDLOOP_LEARNER_METRICS_PORT \
          WORLDLOOP_ACTOR_METRICS_PREFIX WORLDLOOP_JUDGE_METRICS_PREFIX; do
  if [ -z "${!_v:-}" ]; then
    echo "worldloop deploy: $_v is not set (in ${WORLDLOOP_ENV_FILE:-$here/worldloop.env})" >&2
    exit 2
  fi
done
case "$WORLDLOOP_LEARNER_STOPWAITSECS" in
  ''|*[!0-9]*) echo "worldloop deploy: WORLDLOOP_LEARNER_STOPWAITSECS must be whole seconds, got '$WORLDLOOP_LEARNER_STOPWAITSECS'" >&2; exit 2 ;;
esac
case "$WORLDLOOP_HEAD_NODE" in
  true|false) ;;
  *) echo "worldloop deploy: WORLDLOOP_HEAD_NODE must be true or false, got '$WORLDLOOP_HEAD_NODE'" >&2; exit 2 ;;
esac
unset _v
