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
: "${WORLDLOOP_REDIS_APPENDFSYNC:=everysec}"   # always: a host crash loses no acknowledged write
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
case "$WORLDLOOP_REDIS_APPENDFSYNC" in
  always|everysec) ;;
  *) echo "worldloop deploy: WORLDLOOP_REDIS_APPENDFSYNC must be always or everysec, got '$WORLDLOOP_REDIS_APPENDFSYNC'" >&2; exit 2 ;;
esac
case "$WORLDLOOP_HEAD_NODE" in
  true|false) ;;
  *) echo "worldloop deploy: WORLDLOOP_HEAD_NODE must be true or false, got '$WORLDLOOP_HEAD_NODE'" >&2; exit 2 ;;
esac
unset _v
case "$WORLDLOOP_REDIS_URL" in
  *://*:*@*|*[?\&]password=*|*[?\&]ssl_password=*) echo "worldloop deploy: WORLDLOOP_REDIS_URL holds a password: it would be on every command line (ps); put it in WORLDLOOP_REDIS_PASSWORD" >&2; exit 2 ;;
esac

# private_dir DIR [create]: DIR (the supervisor's socket and pid file) is a folder only we may
# write: created mode 700 when missing (with "create"), refused when it is a symlink, belongs to
# another user, or others may write to it. On a shared host another user could otherwise make it
# first (mkdir -p would quietly use theirs) and serve or take over our supervisor socket.
private_dir() {
  local d=$1 owner mode
  if [ ! -e "$d" ] && [ "${2:-}" = create ]; then
    (umask 077 && mkdir -p -- "$d") || return 2
  fi
  if [ -L "$d" ] || [ ! -d "$d" ]; then
    echo "worldloop deploy: WORLDLOOP_SUPERVISOR_DIR $d is not a folder of ours (missing, or a symlink)" >&2
    return 2
  fi
  owner=$(stat -c %u -- "$d") mode=$(stat -c %a -- "$d")
  if [ "$owner" != "$(id -u)" ]; then
    echo "worldloop deploy: WORLDLOOP_SUPERVISOR_DIR $d belongs to uid $owner, not to us (uid $(id -u)): refusing to use it" >&2
    return 2
  fi
  if (( 8#$mode & 8#022 )); then
    echo "worldloop deploy: WORLDLOOP_SUPERVISOR_DIR $d is writable by others (mode $mode): refusing; chmod 700 it" >&2
    return 2
  fi
}
