#!/usr/bin/env bash
# supervisord's [program:redis]: redis-server for the run; WORLDLOOP_REDIS_PASSWORD (if set) goes in
# through stdin as `requirepass`, never on the command line.
set -euo pipefail
# a Redis that other hosts reach needs a password: whoever reaches it can write trajectories with
# any rewards into the run (common/exposure.py does the same for worldloop's own redis-server)
for addr in $WORLDLOOP_REDIS_BIND; do
  case "$addr" in
    127.*|::1|-::1|localhost) ;;
    *) if [ -z "${WORLDLOOP_REDIS_PASSWORD:-}" ]; then
         echo "worldloop deploy: refusing to start redis-server on $addr without a password: set WORLDLOOP_REDIS_PASSWORD, or bind 127.0.0.1" >&2
         exit 2
       fi ;;
  esac
done
# appendfsync: always = a host crash loses no acknowledged write; everysec = up to the last second
# of them (docs/architecture.md "Durability")
args=(--port "$WORLDLOOP_REDIS_PORT" --bind "$WORLDLOOP_REDIS_BIND" --dir "$WORLDLOOP_RUN_DIR" --appendonly yes
      --appendfsync "${WORLDLOOP_REDIS_APPENDFSYNC:-everysec}" --daemonize no)
if [ -n "${WORLDLOOP_REDIS_PASSWORD:-}" ]; then
  pw=${WORLDLOOP_REDIS_PASSWORD//\\/\\\\}
  exec redis-server - "${args[@]}" <<< "requirepass \"${pw//\"/\\\"}\""
fi
exec redis-server "${args[@]}"
