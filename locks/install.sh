#!/usr/bin/env bash
# Run one install command with its output kept in a log; on failure print one line naming what failed.
#
#   bash locks/install.sh LOG COMMAND ARGS...
#
# pip and uv bury the failing package under pages of resolver or build output; a reader needs the package and the
# reason. The line is the installer's own first error line (pip's `ERROR: ...`, uv's `error: ...` / `× ...` and the
# `Because ...` that follows), prefixed with the command's first word; the whole output stays in LOG.
set -uo pipefail
log="$1"; shift
# a log that cannot be written is said as such, not blamed on the command that never ran
if ! { mkdir -p "$(dirname "$log")" && echo "+ $*" >>"$log"; } 2>/dev/null; then
  echo "install: cannot write the install log $log (a directory where it should be, no space or no permission)" >&2
  exit 2
fi
if "$@" >>"$log" 2>&1; then exit 0; else rc=$?; fi
reason=$(grep -E -m 3 '^(ERROR:|error:|  × |× |  ╰─▶ |Because )' "$log" | sed -E 's/^ *(× |╰─▶ )//' | tr '\n' ' ' | cut -c1-400)
echo "install failed ($(basename "$1") exit $rc): ${reason:-see the log} (full log: $log)" >&2
exit "$rc"
