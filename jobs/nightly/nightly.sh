#!/usr/bin/env bash
# Nightly batchrun: one dated dataset per day under OUTPUT_ROOT, safe to rerun, non-zero on any
# failed shard.
#
#   jobs/nightly/nightly.sh OUTPUT_ROOT [batchrun overrides ...]
#   jobs/nightly/nightly.sh s3://bucket/nightly job=summarize data.uri=s3://bucket/inbox/today
#
# Output goes to OUTPUT_ROOT/YYYY-MM-DD (UTC today, or BATCHRUN_NIGHTLY_DATE to redo a given day).
# Rerunning the same day skips shards already committed there and redoes the rest, so a crashed,
# killed or preempted night is finished by running this again; two runs of one day at once are kept
# apart by a lock (and would still never commit a shard twice). Exit status: batchrun's own
# (0 every shard committed, 1 some shard failed or the run could not start, 2 config error,
# 130/143 stopped), or 75 when another run of the same day holds the lock.
#
# Environment: BATCHRUN_PYTHON (default python), BATCHRUN_NIGHTLY_DATE, BATCHRUN_NIGHTLY_LOCK_DIR
# (default $XDG_RUNTIME_DIR/batchrun, else ~/.cache/batchrun; created 0700, refused when others can
# write it). For several local workers add launcher.num_workers=N to the overrides.
set -uo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 OUTPUT_ROOT [batchrun overrides ...]" >&2
    exit 2
fi
root=${1%/}
shift
day=${BATCHRUN_NIGHTLY_DATE:-$(date -u +%F)}
if ! [[ $day =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}$ ]]; then
    echo "nightly: BATCHRUN_NIGHTLY_DATE must be YYYY-MM-DD, got '$day'" >&2
    exit 2
fi
out="$root/$day"
python=${BATCHRUN_PYTHON:-python}

# The lock lives in a directory only this user can write: a predictable name in a shared /tmp lets
# another user pre-create it (and hold it, or point it elsewhere with a symlink).
lock_dir=${BATCHRUN_NIGHTLY_LOCK_DIR:-${XDG_RUNTIME_DIR:-${HOME:?}/.cache}/batchrun}
mkdir -p -m 700 "$lock_dir" || exit 2
if [ ! -O "$lock_dir" ] || [ -n "$(find "$lock_dir" -maxdepth 0 -perm /022)" ]; then
    echo "nightly: lock directory $lock_dir must be owned by $(id -un) and not writable by others" >&2
    exit 2
fi
lock="$lock_dir/nightly-$(printf '%s' "$out" | cksum | cut -d' ' -f1).lock"
if [ -L "$lock" ]; then
    echo "nightly: refusing the lock $lock: it is a symbolic link" >&2
    exit 2
fi
exec 9>"$lock"
if command -v flock >/dev/null && ! flock -n 9; then
    echo "nightly: another run for $out is in progress (lock $lock)" >&2
    exit 75
fi

echo "nightly: $(date -u +%FT%TZ) run for $day -> $out"
# In the background so that a SIGTERM/SIGINT to this script (systemctl stop, Ctrl-C) reaches batchrun
# once, as a graceful stop: bash runs traps only between commands.
"$python" -m batchrun quiet=true "output.uri=$out" "$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM
trap 'kill -INT "$child" 2>/dev/null' INT
while true; do
    wait "$child"
    rc=$?
    kill -0 "$child" 2>/dev/null || break  # still running: wait returned for a trapped signal
done
echo "nightly: $(date -u +%FT%TZ) finished for $day with exit $rc"
exit "$rc"
