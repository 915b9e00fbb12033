#!/usr/bin/env bash
# supervisord's [program:redis]: redis-server for the run; WORLDLOOP_REDIS_PASSWORD (if set) goes in
# through stdin as `requirepass`, never on the command line.
set -euo pipefail
args=(--port "$WORLDLOOP_REDIS_PORT" --bind "$WORLDLOOP_REDIS_BIND" --dir "$WORLDLOOP_RUN_DIR" --appendonly yes --daemonize no)
if [ -n "${WORLDLOOP_REDIS_PASSWORD:-}" ]; then
  pw=${WORLDLOOP_REDIS_PASSWORD//\\/\\\\}
  exec redis-server - "${args[@]}" <<< "requirepass \"${pw//\"/\\\"}\""
fi
exec redis-server "${args[@]}"
