"""`python -m batchrun status OUTPUT_URI`: where a run stands, read from its output directory alone.

It works from any machine that can read the store, during and after a run, and never changes the
store: no write, no claim, no clock probe (claims.py measures the store's clock by writing a file;
this reader does not). What it reads:

    _commits/{shard}.json        committed shards: rows, tokens, errors, committed_at, worker
    _claims/{shard}/{gen}.json   the newest claim: running (who, since when), released, failed, quarantined
    _parts/{shard}/{k}.json      checkpoints of shards not committed yet: their rows (and the parts'
                                 Parquet files for their tokens and errors)
    _manifest*.json              the workers (start times, status, pids) and every shard each worker
                                 was assigned, with its failure message; the job's name and lease
    _plan.json                   the shard list, when work stealing is off
    _fingerprint.json            the run's settings and model

What it can and cannot know:
- A shard is listed when anything in the store names it: a marker, a claim, parts, a manifest
  record or the plan. Each worker's manifest lists that worker's own shards from its start, so once
  every worker has started, every shard is known; before that, a shard nobody started and no plan
  lists is unknown. The manifests' `num_shards_total` still counts it (`num_unknown`), and
  `--data URI` lists the inputs themselves.
- A running claim is judged live by its age: the store's modification time against THIS host's
  clock (claims.py compares with the store's own clock, which needs a write). A claim older than
  the run's `launcher.claim_lease_s` is reported `stalled` (its owner died or froze, or this
  host's clock runs ahead of the store's); on the owner's own machine a gone pid proves it dead.
- Throughput is the rows and tokens done over the span from the run's first start to its latest
  commit (markers' and parts' timestamps, written by the workers' clocks); the ETA assumes the
  shards left are as large as the committed ones on average. Neither is known before a commit.
- The exit status is the run's as of now: 0 every shard committed; 1 some shard failed or is
  quarantined and nothing runs any more; `running` while a claim is live or a worker's manifest
  says running and was written within a lease; `interrupted` when nothing runs and shards are
  left (a rerun of the same command finishes them).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
import posixpath
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Optional, Union

from batchrun.job.commit.checkpoints import Part, committed_parts, read_result_columns
from batchrun.job.commit.claims import FAILED, QUARANTINED, RUNNING, process_identity, process_start_time, store_mtime
from batchrun.job.commit.fence import FENCE_FILE
from batchrun.job.commit.manifest import STATUS_RANK, read_worker_manifests
from batchrun.job.commit.store import RunStore
from batchrun.job.shards import discover_shards, is_safe_name, open_filesystem
from batchrun.utils.redact import redact_text

# A shard's state in a status report.
COMMITTED, STALLED, PENDING = "committed", "stalled", "pending"
STATES = (COMMITTED, RUNNING, STALLED, PENDING, FAILED, QUARANTINED)
DEFAULT_LEASE_S = 120.0  # launcher.claim_lease_s's default, for a run whose manifest is not there
SCHEMA_FILE = "status.schema.json"

ExitStatus = Union[int, str]  # 0, 1, "running" or "interrupted"


@dataclass(frozen=True)
class ShardStatus:
    name: str
    state: str  # one of STATES
    input: Optional[str] = None  # the input file's URL, where the store names it
    worker: Optional[int] = None  # the rank that committed it, or runs it
    owner: Optional[str] = None  # the running claim's owner (host:pid:id)
    since: Optional[str] = None  # running: when its worker started it; committed: when it started
    committed_at: Optional[str] = None
    claim_age_s: Optional[float] = None  # running or stalled: its claim's age by this host's clock
    num_rows: int = 0  # result rows done: the marker's, or those of its committed parts
    num_parts: int = 0  # committed checkpoint parts (shards not committed yet)
    num_errors: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: Optional[str] = None  # why it failed or is quarantined, when a manifest says


@dataclass(frozen=True)
class StatusReport:
    output_uri: str  # credentials redacted
    checked_at: str
    job: Optional[str]
    fingerprint: Optional[dict[str, Any]]  # {"id", "model_sha256", "created_at", "settings"}
    exit_status: ExitStatus
    counts: dict[str, int]  # state -> shards, every state of STATES present
    num_shards_known: int
    num_unknown: int  # shards the manifests or --data count but nothing in the store names
    num_rows_done: int
    num_errors: int
    error_counts: dict[str, int]
    num_prompt_tokens: int
    num_output_tokens: int
    started_at: Optional[str]
    last_commit_at: Optional[str]
    rows_per_s: Optional[float]
    output_tokens_per_s: Optional[float]
    eta_s: Optional[float]
    workers: list[dict[str, Any]]
    shards: list[ShardStatus] = field(default_factory=list)
    # A reasoning model's run: of num_output_tokens, those of the committed shards' traces (their
    # metrics); null for any other run.
    num_reasoning_tokens: Optional[int] = None

    def to_json(self) -> dict[str, Any]:
        """The report as a document that validates against status.schema.json."""
        return dataclasses.asdict(self)


def read_status(
    uri: str,
    storage_options: Optional[Mapping[str, Any]] = None,
    data_uri: Optional[str] = None,
    data_storage_options: Optional[Mapping[str, Any]] = None,
    now: Optional[float] = None,
) -> StatusReport:
    """Read the run at `uri` (see the module docstring); `data_uri` lists the inputs as well."""
    store = RunStore(uri, storage_options or {})
    now = time.time() if now is None else now
    markers = {name: store.read_marker(name) or {} for name in sorted(store.committed_shards())}
    claims = _read_claims(store)
    parts = {name: ps for name, ps in committed_parts(store).items() if name not in markers}
    workers = _worker_manifests(store)
    plan = store.read_json(store.path("_plan.json"))
    fence = store.read_json(store.path(FENCE_FILE))

    config = next((w.get("config") for w in workers if isinstance(w.get("config"), dict)), None) or {}
    lease_s = _float((config.get("launcher") or {}).get("claim_lease_s")) or DEFAULT_LEASE_S
    inputs: dict[str, Optional[str]] = {}  # every shard the store names -> its input URL
    records: dict[str, tuple[dict[str, Any], Optional[int]]] = {}  # shard -> (best manifest record, its rank)
    for doc in workers:
        rank = (doc.get("worker") or {}).get("rank")
        for record in doc.get("shards") or []:
            if not isinstance(record, dict) or not isinstance(record.get("name"), str):
                continue
            inputs.setdefault(record["name"], record.get("input"))
            best = records.get(record["name"])
            rank_of = STATUS_RANK.get
            if best is None or rank_of(record.get("status", ""), 0) > rank_of(best[0].get("status", ""), 0):
                records[record["name"]] = (record, rank)
    if isinstance(plan, dict):
        for entry in plan.get("shards") or []:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                inputs.setdefault(entry["name"], entry.get("url"))
    listed = 0
    if data_uri is not None:
        data_format = (config.get("data") or {}).get("format") or "parquet"
        fs, path = open_filesystem(data_uri, data_storage_options or {})
        same_fs = type(fs) is type(store.fs) and fs.protocol == store.fs.protocol
        listed_shards = discover_shards(fs, path, data_uri, store.root if same_fs else None, data_format)
        listed = len(listed_shards)
        for shard in listed_shards:
            inputs.setdefault(shard.name, shard.url)
    for name in [*markers, *claims, *parts]:
        inputs.setdefault(name, None)

    if not (inputs or workers or isinstance(fence, dict)):
        raise FileNotFoundError(f"no batchrun run at {redact_text(store.url(store.root))}")
    identity = process_identity()
    shards = []
    for name in sorted(n for n in inputs if is_safe_name(n)):
        record, rank = records.get(name, ({}, None))
        shards.append(
            _shard_status(
                name, inputs[name], markers.get(name), claims.get(name), parts.get(name, []), record, rank,
                store, now, lease_s, identity,
            )
        )  # fmt: skip
    counts = {state: sum(s.state == state for s in shards) for state in STATES}
    expected = max([len(plan.get("shards") or []) if isinstance(plan, dict) else 0, listed] + _totals(workers))
    num_unknown = max(0, expected - len(shards))

    error_counts: dict[str, int] = {}
    for marker in markers.values():
        for key, value in (marker.get("error_counts") or {}).items():
            error_counts[key] = error_counts.get(key, 0) + int(value)
    for ps in parts.values():
        for key, value in _parts_tally(store, ps)[3].items():
            error_counts[key] = error_counts.get(key, 0) + value
    num_rows = sum(s.num_rows for s in shards)
    out_tokens = sum(s.num_output_tokens for s in shards)
    starts = [w.get("started_at") for w in workers] + [m.get("started_at") for m in markers.values()]
    commits = [m.get("committed_at") for m in markers.values()] + [p.committed_at for ps in parts.values() for p in ps]
    started_at = min((s for s in starts if isinstance(s, str)), default=None)
    last_commit_at = max((c for c in commits if isinstance(c, str)), default=None)
    span = _seconds(last_commit_at) - _seconds(started_at) if started_at and last_commit_at else None
    rows_per_s = num_rows / span if span and span > 0 else None
    tokens_per_s = out_tokens / span if span and span > 0 else None

    running = counts[RUNNING] > 0 or any(_worker_running(w, now, lease_s) for w in workers)
    left = len(shards) - counts[COMMITTED] + num_unknown
    if left == 0 and shards:
        exit_status: ExitStatus = 0
    elif running:
        exit_status = "running"
    elif counts[FAILED] or counts[QUARANTINED]:
        exit_status = 1
    else:
        exit_status = "interrupted"
    eta_s = None
    if exit_status == 0:
        eta_s = 0.0
    elif exit_status == "running" and rows_per_s and counts[COMMITTED]:
        mean_rows = sum(s.num_rows for s in shards if s.state == COMMITTED) / counts[COMMITTED]
        unfinished = [s for s in shards if s.state in (RUNNING, STALLED, PENDING)]
        remaining = mean_rows * (len(unfinished) + num_unknown) - sum(s.num_rows for s in unfinished)
        eta_s = max(0.0, remaining) / rows_per_s

    return StatusReport(
        output_uri=redact_text(store.url(store.root)),
        checked_at=_iso(now),
        job=(config.get("job") or {}).get("name"),
        fingerprint=_fingerprint(fence),
        exit_status=exit_status,
        counts=counts,
        num_shards_known=len(shards),
        num_unknown=num_unknown,
        num_rows_done=num_rows,
        num_errors=sum(s.num_errors for s in shards),
        error_counts=dict(sorted(error_counts.items())),
        num_prompt_tokens=sum(s.num_prompt_tokens for s in shards),
        num_output_tokens=out_tokens,
        started_at=started_at,
        last_commit_at=last_commit_at,
        rows_per_s=rows_per_s,
        output_tokens_per_s=tokens_per_s,
        eta_s=eta_s,
        workers=[_worker_summary(w) for w in workers],
        shards=shards,
        num_reasoning_tokens=_reasoning_tokens(markers.values()),
    )


def _reasoning_tokens(markers: Any) -> Optional[int]:
    """The committed shards' trace tokens, where their metrics count them (a reasoning model's run)."""
    counts = [(m.get("metrics") or {}).get("num_reasoning_tokens") for m in markers]
    known = [int(c) for c in counts if c is not None]
    return sum(known) if known else None


def _shard_status(
    name: str,
    input_url: Optional[str],
    marker: Optional[dict[str, Any]],
    claim: Optional[tuple[dict[str, Any], Optional[float]]],
    parts: Sequence[Part],
    record: Mapping[str, Any],
    rank: Optional[int],
    store: RunStore,
    now: float,
    lease_s: float,
    identity: Mapping[str, Any],
) -> ShardStatus:
    if marker is not None:
        metrics = marker.get("metrics") or {}
        return ShardStatus(
            name,
            COMMITTED,
            input=marker.get("input") or input_url,
            worker=marker.get("worker"),
            since=marker.get("started_at"),
            committed_at=marker.get("committed_at"),
            num_rows=_int(marker.get("num_rows")),
            num_errors=_int(metrics.get("num_errors")),
            num_prompt_tokens=_int(metrics.get("num_prompt_tokens")),
            num_output_tokens=_int(metrics.get("num_output_tokens")),
        )
    rows, prompt_tokens, output_tokens, errors = _parts_tally(store, parts)
    done: dict[str, Any] = {
        "input": input_url,
        "num_rows": rows,
        "num_parts": len(parts),
        "num_errors": sum(errors.values()),
        "num_prompt_tokens": prompt_tokens,
        "num_output_tokens": output_tokens,
    }
    doc, mtime = claim if claim is not None else ({}, None)
    state = doc.get("state")
    if state == QUARANTINED:
        return ShardStatus(name, QUARANTINED, error=record.get("error"), **done)
    if state == FAILED or (state != RUNNING and record.get("status") == "failed"):
        return ShardStatus(name, FAILED, worker=rank, error=record.get("error"), **done)
    if state == RUNNING:
        age = now - mtime if mtime is not None else None
        stalled = (age is not None and age > lease_s) or _provably_dead(doc, identity)
        worker = parts[-1].worker if parts and parts[-1].owner == doc.get("owner") else None
        since = record.get("started_at") if record.get("status") == "running" else None
        if worker is None and record.get("status") == "running":
            worker = rank
        return ShardStatus(
            name,
            STALLED if stalled else RUNNING,
            worker=worker,
            owner=doc.get("owner"),
            since=since,
            claim_age_s=age,
            **done,
        )
    return ShardStatus(name, PENDING, **done)  # never claimed, or released (a graceful stop)


def _read_claims(store: RunStore) -> dict[str, tuple[dict[str, Any], Optional[float]]]:
    """shard -> (its newest claim document, the claim file's store modification time)."""
    root = store.path("_claims")
    store.fs.invalidate_cache(root)
    try:
        entries = store.fs.ls(root, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out = {}
    for entry in entries:
        shard = posixpath.basename(entry.rstrip("/"))
        if not is_safe_name(shard):  # .clock, or a foreign file
            continue
        directory = store.path("_claims", shard)
        store.fs.invalidate_cache(directory)
        try:
            files = {
                int(base[:-5]): info
                for info in store.fs.ls(directory, detail=True)
                if (base := posixpath.basename(info["name"])).endswith(".json") and base[:-5].isdigit()
            }
            if not files:
                continue
            newest = max(files)
            doc = json.loads(store.fs.cat_file(files[newest]["name"]))
        except (FileNotFoundError, NotADirectoryError):  # committed meanwhile: its claims were dropped
            continue
        except ValueError:  # mid-write or foreign: judged as a running claim of nobody, by its age
            doc = {"state": RUNNING, "owner": None}
        if isinstance(doc, dict):
            out[shard] = (doc, store_mtime(files[newest]))
    return out


def _parts_tally(store: RunStore, parts: Sequence[Part]) -> tuple[int, int, int, dict[str, int]]:
    """(result rows, prompt tokens, output tokens, errors by type) of committed parts. Rows come
    from the part markers; tokens and errors from the parts' files, which vanish when the shard
    commits meanwhile (then they count as none: the next look finds the marker)."""
    rows = sum(p.num_result_rows for p in parts)
    prompt = output = 0
    errors: dict[str, int] = {}
    for part in parts:
        try:
            with store.fs.open(part.results_path, "rb") as f:
                part_rows = read_result_columns(f, ["error_type", "num_prompt_tokens", "num_output_tokens"])
        except (FileNotFoundError, OSError):
            continue
        for row in part_rows:
            prompt += row["num_prompt_tokens"] or 0
            output += row["num_output_tokens"] or 0
            if row["error_type"] is not None:
                errors[row["error_type"]] = errors.get(row["error_type"], 0) + 1
    return rows, prompt, output, errors


def _worker_manifests(store: RunStore) -> list[dict[str, Any]]:
    """Each worker's own manifest, with its modification time (`_mtime`). One worker's run has
    only `_manifest.json`; with several, `_manifest.json` is their merge and not a worker's."""
    docs = read_worker_manifests(store)
    paths = [store.path(f"_manifest.rank{(d.get('worker') or {}).get('rank')}.json") for d in docs]
    if not docs:
        single = store.read_json(store.path("_manifest.json"))
        if isinstance(single, dict) and (single.get("worker") or {}).get("rank") is not None:
            docs, paths = [single], [store.path("_manifest.json")]
    for doc, path in zip(docs, paths):
        try:
            doc["_mtime"] = store_mtime(store.fs.info(path))
        except (FileNotFoundError, OSError):
            doc["_mtime"] = None
    return docs


def _worker_running(doc: Mapping[str, Any], now: float, lease_s: float) -> bool:
    """A worker's manifest says running and was written within a lease (a worker killed outright
    leaves `running` behind for good; a manifest has no boot id to prove its pid gone)."""
    if doc.get("status") != "running":
        return False
    mtime = doc.get("_mtime")
    return mtime is None or now - mtime <= lease_s


def _provably_dead(claim: Mapping[str, Any], identity: Mapping[str, Any]) -> bool:
    """As claims.ClaimBook._is_dead: same kernel and pid namespace, and the pid is gone or reused."""
    same_kernel = claim.get("boot_id") == identity["boot_id"] and claim.get("pid_ns") == identity["pid_ns"]
    if not identity["boot_id"] or not same_kernel:
        return False
    pid = claim.get("pid")
    if not isinstance(pid, int):
        return False
    start = process_start_time(pid)
    return start is None or (claim.get("pid_start") is not None and start != claim["pid_start"])


def _worker_summary(doc: Mapping[str, Any]) -> dict[str, Any]:
    worker = doc.get("worker") or {}
    settings = doc.get("engine_settings")
    settings = settings if isinstance(settings, dict) else {}
    engine = (doc.get("config") or {}).get("engine")
    # A manifest from before tensor parallelism has no such key: its worker was one process.
    tp = settings.get("tensor_parallel_size") or (engine or {}).get("tensor_parallel_size") or 1
    rank_bytes = settings.get("rank_weight_bytes") or None
    if rank_bytes is None and isinstance(settings.get("weight_bytes"), int) and tp == 1:
        rank_bytes = [settings["weight_bytes"]]
    return {
        "rank": worker.get("rank"),
        "hostname": worker.get("hostname"),
        "pid": worker.get("pid"),
        "status": doc.get("status"),
        "started_at": doc.get("started_at"),
        "finished_at": doc.get("finished_at"),
        "device": worker.get("device"),
        "tensor_parallel_size": _int(tp) or 1,
        "rank_weight_bytes": [_int(b) for b in rank_bytes] if isinstance(rank_bytes, list) else None,
    }


def _totals(workers: Sequence[Mapping[str, Any]]) -> list[int]:
    return [w["num_shards_total"] for w in workers if isinstance(w.get("num_shards_total"), int)]


def _fingerprint(fence: Any) -> Optional[dict[str, Any]]:
    """The run's fingerprint: a short id of its settings and model (equal ids: the same run)."""
    if not isinstance(fence, dict):
        return None
    settings, model = fence.get("settings") or {}, fence.get("model") or {}
    digest = hashlib.sha256(json.dumps({"settings": settings, "model": model}, sort_keys=True).encode()).hexdigest()
    return {
        "id": digest[:16],
        "model_sha256": model.get("model.sha256"),
        "created_at": fence.get("created_at"),
        "settings": settings,
    }


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _float(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def _seconds(iso: str) -> float:
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _iso(seconds: float) -> str:
    moment = dt.datetime.fromtimestamp(seconds, dt.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ---- output -----------------------------------------------------------------------------------


def status_schema() -> dict[str, Any]:
    """The JSON schema `--json` output follows (batchrun/job/operate/status.schema.json)."""
    schema: dict[str, Any] = json.loads(resources.files("batchrun.job.operate").joinpath(SCHEMA_FILE).read_text())
    return schema


def format_status(report: StatusReport, max_shards: int = 50) -> str:
    """The report for a terminal: totals first, then one line per shard, those not committed first,
    up to `max_shards` lines. A shard's time is when it committed, or when its attempt started."""
    c = report.counts
    fp = report.fingerprint
    known = f"{report.num_shards_known + report.num_unknown}"
    unknown = f", {report.num_unknown} not named in the store (--data lists them)" if report.num_unknown else ""
    errors = ", ".join(f"{k} {v}" for k, v in report.error_counts.items())
    lines = [
        f"run:         {report.output_uri}" + (f"  (job {report.job})" if report.job else ""),
        "fingerprint: "
        + (
            f"{fp['id']} (model sha256 {str(fp.get('model_sha256') or '?')[:12]}, created {fp.get('created_at')})"
            if fp
            else "none yet (no worker has loaded its engine)"
        ),
        f"shards:      {c[COMMITTED]} committed, {c[RUNNING]} running, {c[STALLED]} stalled, {c[PENDING]} pending, "
        f"{c[FAILED]} failed, {c[QUARANTINED]} quarantined (of {known}){unknown}",
        f"rows:        {report.num_rows_done} done, {report.num_errors} errors" + (f" ({errors})" if errors else ""),
        f"tokens:      {report.num_output_tokens} output, {report.num_prompt_tokens} prompt"
        + (
            f" ({report.num_reasoning_tokens} output in reasoning traces)"
            if report.num_reasoning_tokens is not None
            else ""
        ),
        "throughput:  "
        + (
            f"{report.rows_per_s:.2f} rows/s, {report.output_tokens_per_s:.1f} output tok/s "
            f"({report.started_at} to {report.last_commit_at})"
            if report.rows_per_s is not None and report.output_tokens_per_s is not None
            else "- (nothing committed yet)"
        ),
        f"eta:         {_duration(report.eta_s)}",
        f"exit status: {report.exit_status}",
    ]
    if report.workers:
        lines.insert(2, f"workers:     {_workers_line(report.workers)}")
    order = sorted(report.shards, key=lambda s: (s.state == COMMITTED, STATES.index(s.state), s.name))
    shown = order[:max_shards]
    if shown:
        rows = [("shard", "state", "worker", "time", "rows", "note")]
        for s in shown:
            note = s.error or ""
            if s.state in (RUNNING, STALLED):
                age = f", claim {s.claim_age_s:.0f}s old" if s.claim_age_s is not None else ""
                note = f"{s.owner or '?'}{age}"
            if s.num_parts:
                note = f"{s.num_parts} part(s); {note}".rstrip("; ")
            since = s.committed_at if s.state == COMMITTED else s.since
            worker = "-" if s.worker is None else str(s.worker)
            rows.append((s.name, s.state, worker, since or "-", str(s.num_rows), note))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines.append("")
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(r[:5], widths)) + "  " + r[5] for r in rows]
        if len(order) > len(shown):
            lines.append(f"... {len(order) - len(shown)} more (--json lists all)")
    return "\n".join(line.rstrip() for line in lines)


def _workers_line(workers: Sequence[Mapping[str, Any]]) -> str:
    """How many workers in which states, each a group of how many ranks (tp) on which devices, and
    the weights each rank holds (the first worker's that knows: every worker loads the same model)."""
    states: dict[str, int] = {}
    for w in workers:
        states[str(w.get("status") or "?")] = states.get(str(w.get("status") or "?"), 0) + 1
    sizes = sorted({int(w.get("tensor_parallel_size") or 1) for w in workers})
    line = f"{len(workers)} (" + ", ".join(f"{n} {state}" for state, n in sorted(states.items())) + ")"
    line += f", tp={'/'.join(map(str, sizes))} each"
    devices = [str(w["device"]) for w in sorted(workers, key=lambda w: w.get("rank") or 0) if w.get("device")]
    if devices:
        line += f" on GPUs {' | '.join(devices)}"
    rank_bytes = next((w["rank_weight_bytes"] for w in workers if w.get("rank_weight_bytes")), None)
    if rank_bytes:
        line += "; weights per rank " + ", ".join(_size(b) for b in rank_bytes)
    return line


def _size(num_bytes: int) -> str:
    value, unit = float(num_bytes), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, next_unit
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def main(argv: Sequence[str]) -> int:
    """`batchrun status OUTPUT_URI [--json] [--watch [SECONDS]] [--data URI]`. Exit 0 once the
    store was read (with --watch: once the run is no longer running), 1 when it cannot be read."""
    parser = argparse.ArgumentParser(
        prog="python -m batchrun status", description="Where a run stands, read from its output directory only."
    )
    parser.add_argument("output_uri", help="the run's output.uri (local path or fsspec URL)")
    parser.add_argument("--json", action="store_true", help="one JSON document (status.schema.json) per look")
    parser.add_argument(
        "--watch", nargs="?", type=float, const=5.0, default=None, metavar="SECONDS", help="look again every SECONDS"
    )
    parser.add_argument("--data", default=None, metavar="URI", help="the run's data.uri: list shards not yet started")
    args = parser.parse_args(list(argv))
    if args.watch is not None and args.watch <= 0:
        parser.error("--watch SECONDS must be > 0")
    while True:
        try:
            report = read_status(args.output_uri, data_uri=args.data)
        except Exception as e:
            message = redact_text(" ".join(f"{type(e).__name__}: {e}".split()))
            print(f"batchrun status: cannot read {redact_text(args.output_uri)}: {message}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(report.to_json(), sort_keys=True), flush=True)
        else:
            if args.watch is not None and sys.stdout.isatty():
                print("\033[H\033[J", end="")
            print(format_status(report), flush=True)
        if args.watch is None or report.exit_status != "running":
            return 0
        if not args.json:
            print(flush=True)
        time.sleep(args.watch)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
