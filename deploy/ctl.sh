#!/usr/bin/env bash
# supervisorctl for deploy/supervisord.conf, e.g. `deploy/ctl.sh status`, `deploy/ctl.sh restart actor:*`.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
set -a; . "${WORLDLOOP_ENV_FILE:-$here/worldloop.env}"; set +a
exec supervisorctl -c "$here/supervisord.conf" "$@"
