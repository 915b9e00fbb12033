#!/usr/bin/env bash
# supervisorctl for deploy/supervisord.conf, e.g. `deploy/ctl.sh status`, `deploy/ctl.sh restart worldloop:actor-00`,
# `deploy/ctl.sh stop worldloop:*` (every program is in the group worldloop).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/env.sh"
exec supervisorctl -c "$here/supervisord.conf" "$@"
