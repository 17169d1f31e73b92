#!/usr/bin/env bash
# `make demo` from a fresh clone: seconds until the virtualenv is installed and until the first
# 200 from POST /v1/generate (docs/benchmarks.md); then SIGTERM to `ddm up`, its exit status
# and whether any of its servers survived.
#   scripts/measure_demo.sh REPOSITORY COMMIT DIR     (DIR: a new directory for the clone)
set -euo pipefail
repository=$1 commit=$2 dir=$3 url=http://127.0.0.1:8080
if curl -s -o /dev/null "$url/healthz"; then echo "port 8080 is taken" >&2; exit 1; fi
git clone -q "$repository" "$dir"
git -C "$dir" checkout -q "$commit"
cd "$dir"
start=$(date +%s.%N)
make demo >demo.log 2>&1 &
make_pid=$!
installed=""
until curl -sf -o /dev/null -X POST "$url/v1/generate" -H 'content-type: application/json' \
        -d '{"labels": [0, 5, 9], "steps": 40, "seed": 0, "strategy": "top1"}'; do
    if [ -z "$installed" ] && compgen -G '.venv/.installed*' >/dev/null; then
        installed=$(date +%s.%N)
    fi
    kill -0 "$make_pid" 2>/dev/null || { tail -20 demo.log; exit 1; }
    sleep 1
done
answered=$(date +%s.%N)
ddm_pid=$(pgrep -P "$make_pid")
children=$(pgrep -P "$ddm_pid" | tr '\n' ' ')
kill -TERM "$ddm_pid"
status=0; wait "$make_pid" || status=$?
sleep 1
survivors=""; for pid in $children; do [ -e "/proc/$pid" ] && survivors="$survivors $pid"; done
echo "commit $(git rev-parse --short HEAD): installed after $(echo "$installed - $start" | bc) s," \
     "first answer after $(echo "$answered - $start" | bc) s; make exited $status;" \
     "survivors:${survivors:- none}"
tail -4 demo.log
