#!/usr/bin/env bash
# Run ci/gpu.sh parts in order while a device call's deadline leaves room for them; the next warm call continues.
#
#   bash ci/gpu-queue.sh SECONDS PART:ESTIMATE [PART:ESTIMATE ...]
#   bash ci/gpu-queue.sh 540 sleep-e2e:220 campaign48:380 transfer48:330
#
# A part starts only while SECONDS (from now) leave its ESTIMATE; it runs in its own process group, killed with every
# engine it started at 1.6x its estimate (or the deadline), so a hang costs its limit, not the call. Parts that ran
# are listed in /tmp/gpu-queue.done: on the same machine the next call skips them (a fresh machine starts over).
# Each part's log is $OUT/<part>.log (the device brings $OUT back; at most 8 files come back per call).
# HWSYNC_STACKS_EVERY=N dumps every Python thread's stack every N s into those logs (ci/stacks); TRL's wheel, when
# the kit's last send carried it to /tmp/gk, is installed once into /tmp/site-trl for the TRL parts.
set -u
if [ $# -lt 2 ]; then
    sed -n '2,4p' "$0" >&2
    exit 2
fi
deadline=$(($(date +%s) + $1))
shift
out="${OUT:-${TMPDIR:-/tmp}}"
done_list=/tmp/gpu-queue.done
touch "$done_list"
wheel=$(find /tmp/gk -maxdepth 1 -name 'trl-*.whl' 2>/dev/null | head -1)
if [ -n "$wheel" ] && [ ! -d /tmp/site-trl ]; then
    python3 -m pip install -q --no-deps --target /tmp/site-trl "$wheel" 2>&1 | tail -1
fi
[ -d /tmp/site-trl ] && export HWSYNC_TRL_PATH=/tmp/site-trl
export HWSYNC_GPU_LOG=0  # one log per part, written here
for item in "$@"; do
    part=${item%%:*} est=${item##*:}
    grep -qx "$part" "$done_list" && continue
    left=$((deadline - $(date +%s)))
    if [ "$left" -lt "$est" ]; then
        echo "gpu-queue: $part (estimate ${est}s) left for the next call (${left}s left)"
        continue
    fi
    echo "$part" >>"$done_list"
    limit=$((est * 16 / 10))
    [ "$left" -lt "$limit" ] && limit=$left
    t0=$(date +%s)
    setsid bash ci/gpu.sh "$part" >"$out/$part.log" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null && [ $(($(date +%s) - t0)) -lt "$limit" ]; do sleep 2; done
    if kill -0 "$pid" 2>/dev/null; then # past its limit: the part and every process it started go
        kill -- -"$pid" 2>/dev/null
        sleep 5
        kill -9 -- -"$pid" 2>/dev/null
    fi
    wait "$pid"
    rc=$?
    echo "gpu-queue: $part exit $rc after $(($(date +%s) - t0))s (limit ${limit}s)"
    tail -25 "$out/$part.log" | cut -c1-400
done
