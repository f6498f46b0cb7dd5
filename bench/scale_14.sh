#!/usr/bin/env bash
# Issue 24's scheduler target, on a machine with 16 cores or more (not a test):
# 14 bare workers x 1 thread, a map of 20,000 no-ops, redisdask and Dask distributed side
# by side (3 alternating runs, medians), with the scheduler's profile (py-spy) in run 1,
# Redis commands, Redis CPU and scheduler CPU per task.  Target: redisdask >= 16,000
# tasks/s (8,092 before the writes in flight; Dask 1,592).
#
#     bench/scale_14.sh [--repeats 5] [--json out.json]     (extra arguments pass through)
#
# Needs: pip install -e '.[bench]' py-spy (py-spy is skipped if it is not installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
cores=$(nproc)
if [ "$cores" -lt 16 ]; then
  echo "warning: $cores cores; the target assumes 16 (14 workers, the scheduler, Redis)" >&2
fi
spy=()
if command -v py-spy >/dev/null || [ -x "$(dirname "$(command -v "$PY")")/py-spy" ]; then
  spy=(--py-spy)
fi
echo "== $(date -u +%FT%TZ) $(uptime)"
exec "$PY" bench/scheduler_wait.py --workers 14 --tasks 20000 --repeats 3 ${spy[@]+"${spy[@]}"} "$@"
