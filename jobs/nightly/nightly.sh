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
# 130/143 stopped), or 75 when another run of the same day holds the lock (flock(1), else Python's
# flock(2): never unlocked). When the last run of OUTPUT_ROOT was another day and did not complete
# (it crashed, was killed, or exited non-zero), that day is rerun first with its own overrides,
# which finishes it, and then today's run starts; the last run's day, status and overrides are kept
# next to the lock.
#
# Environment: BATCHRUN_PYTHON (default python), BATCHRUN_NIGHTLY_DATE, BATCHRUN_NIGHTLY_LOCK_DIR
# (default $XDG_RUNTIME_DIR/batchrun, else ~/.cache/batchrun; created 0700, refused when others can
# write it). For several local workers add launcher.num_workers=N to the overrides.
# Monitoring: each worker writes Prometheus text for node_exporter's textfile collector to
# BATCHRUN_METRICS_TEXTFILE (output.metrics_textfile; empty: none), by default
# $BATCHRUN_TEXTFILE_DIR/batchrun-<last part of OUTPUT_ROOT>.prom when that directory exists and is
# writable (default /var/lib/node_exporter/textfile_collector); one file for all days, so
# batchrun_last_success_timestamp_seconds says when a night last succeeded. With several workers
# each writes its own (.rank<r>.prom). An output.metrics_textfile override wins.
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
textfile_dir=${BATCHRUN_TEXTFILE_DIR:-/var/lib/node_exporter/textfile_collector}
if [ -z "${BATCHRUN_METRICS_TEXTFILE+set}" ] && [ -d "$textfile_dir" ] && [ -w "$textfile_dir" ]; then
    name=$(printf '%s' "${root##*/}" | tr -c 'A-Za-z0-9._-' '_')
    BATCHRUN_METRICS_TEXTFILE="$textfile_dir/batchrun-${name:-nightly}.prom"
fi
metrics=()
[ -n "${BATCHRUN_METRICS_TEXTFILE:-}" ] && metrics=("output.metrics_textfile=$BATCHRUN_METRICS_TEXTFILE")

# The lock lives in a directory only this user can write: a predictable name in a shared /tmp lets
# another user pre-create it (and hold it, or point it elsewhere with a symlink).
lock_dir=${BATCHRUN_NIGHTLY_LOCK_DIR:-${XDG_RUNTIME_DIR:-${HOME:?}/.cache}/batchrun}
mkdir -p -m 700 "$lock_dir" || exit 2
if [ ! -O "$lock_dir" ] || [ -n "$(find "$lock_dir" -maxdepth 0 -perm /022)" ]; then
    echo "nightly: lock directory $lock_dir must be owned by $(id -un) and not writable by others" >&2
    exit 2
fi
# lock_path DAY: the lock of OUTPUT_ROOT/DAY; lock FD: take it without waiting on the file open at FD:
# 0 taken, 75 another run holds it. flock(1) where installed, else Python's flock(2) on the same
# open file, which outlives the Python process because this shell keeps the file open.
lock_path() { echo "$lock_dir/nightly-$(printf '%s' "$root/$1" | cksum | cut -d' ' -f1).lock"; }
lock() {
    if command -v flock >/dev/null; then
        flock -n "$1" && return 0
        return 75
    fi
    "$python" -c '
import fcntl, sys
try:
    fcntl.flock(int(sys.argv[1]), fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    sys.exit(75)' "$1"
}
lock="$(lock_path "$day")"
if [ -L "$lock" ]; then
    echo "nightly: refusing the lock $lock: it is a symbolic link" >&2
    exit 2
fi
exec 9>"$lock"
lock 9
held=$?
if [ "$held" = 75 ]; then
    echo "nightly: another run for $out is in progress (lock $lock)" >&2
    exit 75
elif [ "$held" != 0 ]; then
    echo "nightly: cannot take the lock $lock (exit $held)" >&2
    exit 2
fi

# The last run of this OUTPUT_ROOT: "DAY STATUS" (STATUS: running, or its exit status) and its
# overrides. A day whose run crashed (still "running") or failed is finished first, with its own
# overrides (they may name that day's input), before today's run starts.
state="$lock_dir/nightly-$(printf '%s' "$root" | cksum | cut -d' ' -f1).last"
record() {  # record DAY STATUS [overrides ...]: replaced whole, never half-written
    local d=$1 status=$2
    shift 2
    if [ "$status" = running ]; then
        printf '%s\0' "$@" >"$state.args.tmp" && mv -f "$state.args.tmp" "$state.args"
    fi
    printf '%s %s\n' "$d" "$status" >"$state.tmp" && mv -f "$state.tmp" "$state"
}

child= stop=
trap 'stop=143; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM
trap 'stop=130; [ -n "$child" ] && kill -INT "$child" 2>/dev/null' INT
run_day() {  # run_day DAY [overrides ...]: batchrun into OUTPUT_ROOT/DAY; its exit status in $rc
    local d=$1
    shift
    echo "nightly: $(date -u +%FT%TZ) run for $d -> $root/$d"
    # In the background so that a SIGTERM/SIGINT to this script (systemctl stop, Ctrl-C) reaches
    # batchrun once, as a graceful stop: bash runs traps only between commands.
    "$python" -m batchrun quiet=true "output.uri=$root/$d" ${metrics[@]+"${metrics[@]}"} "$@" &
    child=$!
    while true; do
        wait "$child"
        rc=$?
        kill -0 "$child" 2>/dev/null || break  # still running: wait returned for a trapped signal
    done
    child=
    echo "nightly: $(date -u +%FT%TZ) finished for $d with exit $rc"
}

last_day= last_status=
[ -f "$state" ] && read -r last_day last_status <"$state"
if [[ $last_day =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}$ ]] && [ "$last_day" != "$day" ] && [ "$last_status" != 0 ]; then
    last_lock="$(lock_path "$last_day")"
    if [ -L "$last_lock" ]; then
        echo "nightly: refusing the lock $last_lock: it is a symbolic link" >&2
        exit 2
    fi
    exec 8>"$last_lock"
    if lock 8; then
        last_args=()
        [ -f "$state.args" ] && mapfile -d '' -t last_args <"$state.args"
        echo "nightly: the run for $last_day did not complete ($last_status); finishing it first"
        record "$last_day" running "${last_args[@]}"
        run_day "$last_day" "${last_args[@]}"
        record "$last_day" "$rc"
        case $rc in 130 | 143) exit "$rc" ;; esac  # stopped: today's run waits for the next start
    else
        echo "nightly: another run for $root/$last_day holds its lock; not finishing it here" >&2
    fi
    exec 8>&-
fi

[ -n "$stop" ] && exit "$stop"  # stopped between the two runs
record "$day" running "$@"
run_day "$day" "$@"
record "$day" "$rc"
exit "$rc"
