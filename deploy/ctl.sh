#!/usr/bin/env bash
# supervisorctl for deploy/supervisord.conf, e.g. `deploy/ctl.sh status`, `deploy/ctl.sh restart worldloop:actor-00`,
# `deploy/ctl.sh stop worldloop:*` (every program is in the group worldloop).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/env.sh"
# talk only to a supervisor whose folder is ours (not one another user set up at that path)
if [ -e "$WORLDLOOP_SUPERVISOR_DIR" ]; then private_dir "$WORLDLOOP_SUPERVISOR_DIR" || exit 2; fi
exec supervisorctl -c "$here/supervisord.conf" "$@"
