#!/usr/bin/env bash
# Start supervisord with deploy/supervisord.conf and the variables of deploy/worldloop.env
# (or the file named by $WORLDLOOP_ENV_FILE). Extra arguments go to supervisord (e.g. -n).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/env.sh"
mkdir -p "$WORLDLOOP_LOG_DIR" "$WORLDLOOP_RUN_DIR" "$(dirname "$WORLDLOOP_SD_FILE")"
private_dir "$WORLDLOOP_SUPERVISOR_DIR" create || exit 2
exec supervisord -c "$here/supervisord.conf" "$@"
