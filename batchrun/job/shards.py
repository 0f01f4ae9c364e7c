"""Which input files make up the run, what each shard is called, and which worker takes which.

Shard names are the input path relative to `data.uri`'s directory, without the suffix and with '/'
turned into '__' (a flat directory gives plain file stems). A name that would not be a plain, safe
file name (empty, `.`/`..`, a leading dot, separators, control or other unusual characters, more
than NAME_MAX_BYTES) becomes a readable slug plus a short hash of the relative path instead, so no
input name can address anything outside its own files in the output directory. The name depends
only on the file's own path, never on which other files exist, so adding inputs later cannot rename
a committed shard.

Names must also differ in more than letter case: on a case-insensitive output filesystem (macOS,
SMB and most Windows shares) `Data` and `data` would share one commit marker, so the second shard
would be reported done with its rows never answered. Discovery refuses such a pair with a JobError
naming both files rather than renaming either: a rename that depended on the other file would
break the promise above, and one for every name with an uppercase letter would rename shards that
earlier runs committed under their plain names.

Discovery takes the input format's files only, by extension (`*.parquet`, or `*.jsonl` OpenAI batch
files with data.format=openai_batch; the Parquet reader checks the magic bytes), skips hidden
and `_`-prefixed files (Spark's `_SUCCESS`, checksums, our own output), and never takes files under
the run's own output directory when that lies inside the input.

An http(s) data.uri is one file, often a signed URL (S3/GCS presigned, Azure SAS) whose query is
a credential that expires: its format and shard name come from the URL's path alone (the
percent-decoded basename, without suffix), so a rerun with a freshly signed URL of the same file
is the same shard, and its version from the server's ETag (else Last-Modified). It is read through
SignedURLFileSystem (fsspec's HTTP filesystem, minus what a signed URL cannot do), and everything
written or logged names it with its query redacted (Shard.url). A 4xx answer is a ConfigError
naming data.uri with the status. A path with a version query (s3fs's `?versionId=`) is one file
named the same way.

A previous run's output directory (it has `_commits/`) as data.uri is read through its commit
markers: one shard per committed shard, named as there, its committed results file (published, or
the attempt the marker names while publication is pending), each row once; never metrics/,
_attempts/, _parts/ or anything uncommitted. Shards of that run that are not committed yet are not
inputs (a rerun after they commit takes them).

Assignment is round-robin over shards sorted by name: worker `rank` of `world_size` takes shards
rank, rank + world_size, ... It needs no file sizes (no extra listing on object stores) and every
worker computes the same split independently; with many similar shards it balances well enough.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import posixpath
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp
import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.http import HTTPFileSystem

from batchrun.job.config import LauncherConfig
from batchrun.job.errors import ConfigError, JobError, ShardError
from batchrun.utils.redact import redact_query


@dataclass(frozen=True)
class Shard:
    name: str  # unique within the run; names the output files
    path: str  # path inside the filesystem (what fs.open takes)
    url: str  # the same with its protocol, for logs and the manifest (an http(s) URL's query redacted)
    size: Optional[int] = None  # bytes, as listed
    version: Optional[str] = None  # ETag on object stores, else the modification time, as listed


@dataclass(frozen=True)
class Worker:
    rank: int
    world_size: int
    source: str  # where rank and world size came from, for the log and the manifest
    device: Optional[str] = None  # the GPU(s) given to this worker (CUDA_VISIBLE_DEVICES); None: not set


log = logging.getLogger(__name__)

_GLOB_CHARS = re.compile(r"[*?\[]")
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=-]*")
_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]+")
# Shard names become parts of file names (`{name}.parquet`, `{name}.json`, claim directories); the
# common file-name limit is 255 bytes, and a slug plus hash must stay well within it.
NAME_MAX_BYTES = 150
PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")
JSONL_SUFFIXES = (".jsonl",)
# data.format -> (the suffixes its files have, what messages call them)
FORMAT_FILES: dict[str, tuple[tuple[str, ...], str]] = {
    "parquet": (PARQUET_SUFFIXES, "Parquet files (*.parquet)"),
    "openai_batch": (JSONL_SUFFIXES, "OpenAI batch files (*.jsonl)"),
}


def open_filesystem(uri: str, storage_options: Mapping[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    """fsspec filesystem and in-filesystem path for a local path or any fsspec URL (an http(s)
    URL: SignedURLFileSystem, whose paths are the URLs themselves)."""
    if is_http_url(uri):
        options = dict(storage_options)
        # A signature covers the URL's bytes as issued: sent as written unless it is not valid
        # percent-encoded URL text at all (yarl would re-quote `%40`, `%2F` in the query, ...).
        options.setdefault("encoded", bool(_ENCODED_URL.fullmatch(uri)))
        return SignedURLFileSystem(**options), uri
    fs, path = url_to_fs(uri, **dict(storage_options))
    return fs, str(path)


# Every character a percent-encoded URL may hold (RFC 3986), and only valid escapes.
_ENCODED_URL = re.compile(r"(?:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})*")


def is_http_url(uri: str) -> bool:
    return urllib.parse.urlsplit(uri).scheme.lower() in ("http", "https")


class URLStatusError(OSError):
    """An http(s) input answered with an error status. The message names the URL with its query
    redacted; `hint` says what a signed URL's refusal usually means."""

    def __init__(self, url: str, status: int, reason: Optional[str]) -> None:
        self.status = status
        self.reason = reason or ""
        signed = bool(urllib.parse.urlsplit(url).query)
        # 401/403 (S3, Azure) and 400 (GCS: ExpiredToken) are how object stores refuse a signature
        self.hint = " (expired or revoked signature?)" if signed and status in (400, 401, 403) else ""
        super().__init__(f"{redact_query(url)}: HTTP {status} {self.reason}".rstrip())


class URLNotFoundError(URLStatusError, FileNotFoundError):
    """404: fsspec's callers (and refreshed) take it as a file that does not exist."""


class SignedURLFileSystem(HTTPFileSystem):  # type: ignore[misc]
    """fsspec's HTTP filesystem for a data.uri that is one file's URL, signed or not.

    A presigned GET URL signs its method, so HEAD, with which fsspec sizes a file, gets 403 (S3,
    R2) or 405; and fsspec's fallback GETs the whole object without reporting the status. Here
    `info` asks HEAD, then one GET of the first byte, and raises URLStatusError with the status
    when both are refused. A URL is never a directory (fsspec's would GET it to scrape links).
    Reads (HTTPFile) are GETs with Range, which a signed GET URL allows.
    """

    async def _info(self, url: str, **kwargs: Any) -> dict[str, Any]:
        session = await self.set_session()
        options = {**self.kwargs, **kwargs}
        # identity: Content-Length must be the stored size, not a compressed transfer's
        headers = {**options.pop("headers", {}), "Accept-Encoding": "identity"}
        options.setdefault("allow_redirects", True)
        try:
            async with session.head(self.encode_url(url), headers=headers, **options) as r:
                info = _response_info(r, url)
                if r.status < 400 and info.get("size") is not None:
                    return info
        except aiohttp.ClientError:
            pass  # a server that drops HEAD; the GET below says what is wrong, if anything
        async with session.get(self.encode_url(url), headers={**headers, "Range": "bytes=0-0"}, **options) as r:
            if r.status >= 400:
                error = URLNotFoundError if r.status == 404 else URLStatusError
                raise error(url, r.status, r.reason)
            info = _response_info(r, url)
            total = (r.headers.get("Content-Range") or "").rpartition("/")[2]
            if r.status == 206 and total.isdigit():
                info["size"] = int(total)
            elif r.status != 206:
                info["partial"] = False  # the whole file came back: the server ignores Range
            return info

    async def _isdir(self, path: str) -> bool:
        return False

    async def _exists(self, path: str, **kwargs: Any) -> bool:
        try:
            await self._info(path, **kwargs)
        except FileNotFoundError:
            return False
        return True

    async def _isfile(self, path: str, **kwargs: Any) -> bool:
        return await self._exists(path, **kwargs)


def _response_info(r: aiohttp.ClientResponse, url: str) -> dict[str, Any]:
    """fsspec's info fields from a HEAD or a full GET: size, validators (the file's version)."""
    info: dict[str, Any] = {"name": url, "type": "file", "size": None}
    encoding = r.headers.get("Content-Encoding", "identity")
    if r.status == 200 and "Content-Length" in r.headers and encoding in ("identity", ""):
        info["size"] = int(r.headers["Content-Length"])
    for field in ("ETag", "Last-Modified"):
        if r.headers.get(field):
            info[field] = r.headers[field]
    if r.headers.get("Accept-Ranges") == "none":
        info["partial"] = False
    return info


def url_file_name(uri: str) -> str:
    """The file name an http(s) URL (or a path with a query) names: its path's last part,
    percent-decoded, without the query."""
    path = urllib.parse.urlsplit(uri).path if is_http_url(uri) else uri.partition("?")[0]
    return posixpath.basename(urllib.parse.unquote(path))


def discover_shards(
    fs: fsspec.AbstractFileSystem, path: str, uri: str, exclude: Optional[str] = None, data_format: str = "parquet"
) -> list[Shard]:
    """The input files of `data_format` at `path` in `fs` (a directory, a glob or one file), sorted
    by shard name.

    `uri` is what the user wrote, for messages; `exclude` is a path in `fs` whose files are never
    inputs (the run's output directory when it lies inside the input). Finding no input is a
    ConfigError naming data.uri.
    """
    if isinstance(fs, SignedURLFileSystem) or _QUERY_PATH.fullmatch(path):
        return [_one_file_shard(fs, path, uri, data_format)]
    path = path.rstrip("/") or path
    excluded = exclude.rstrip("/") + "/" if exclude else None
    if excluded is not None:
        root = _glob_root(path) if _GLOB_CHARS.search(path) else path
        if (root.rstrip("/") + "/").startswith(excluded):
            # a run that reads its own output directory (a previous run's, with on_change=recompute,
            # or its results/) would overwrite what it reads
            raise ConfigError("data.uri", f"{uri} is output.uri or inside it; write the results to another output.uri")
    if data_format == "parquet" and not _GLOB_CHARS.search(path):
        previous = previous_run_shards(fs, path, uri)
        if previous is not None:
            if excluded is not None and excluded.startswith(path + "/"):
                raise ConfigError(
                    "data.uri",
                    f"{uri} is a run's output directory and output.uri lies inside it; write the results elsewhere",
                )
            return previous
    try:
        if _GLOB_CHARS.search(path):
            root = _glob_root(path)
            infos = {p: i for p, i in fs.glob(path, detail=True).items() if i.get("type") == "file"}
        elif fs.isdir(path):
            root = path
            infos = fs.find(path, detail=True)
        elif fs.isfile(path):
            root, infos = posixpath.dirname(path), {path: fs.info(path)}
        else:
            raise ConfigError("data.uri", f"nothing found at {uri}")
    except (OSError, PermissionError) as e:
        raise JobError(f"data.uri: cannot list {uri}: {e}") from None
    candidates = sorted(infos)
    suffixes, kind = FORMAT_FILES[data_format]
    other = f"not {suffixes[0]}"
    files, skipped = [], {"hidden or _-prefixed": 0, other: 0, "inside output.uri": 0}
    for p in candidates:
        rel = posixpath.relpath(p, root) if root else p
        if excluded is not None and (p + "/").startswith(excluded):
            skipped["inside output.uri"] += 1
        elif _is_hidden(rel):
            skipped["hidden or _-prefixed"] += 1
        elif not p.lower().endswith(suffixes):
            skipped[other] += 1
        else:
            files.append(p)
    if any(skipped.values()):
        log.info("data.uri: %s", ", ".join(f"skipped {n} file(s) {why}" for why, n in skipped.items() if n))
    if not files:
        raise ConfigError(
            "data.uri",
            f"no {kind} at {uri}"
            + (f" ({sum(skipped.values())} other files skipped)" if any(skipped.values()) else ""),
        )
    shards = [
        Shard(shard_name(p, root), p, fs.unstrip_protocol(p), infos[p].get("size"), _version(infos[p]))
        for p in sorted(files)
    ]
    # Keyed by the case-folded name: output files named by two shards must stay apart on any
    # filesystem (names are ASCII, so lower() is the folding every filesystem does).
    by_folded: dict[str, Shard] = {}
    for shard in shards:
        first = by_folded.get(shard.name.lower())
        if first is not None and first.name == shard.name:
            raise JobError(f"input files {first.url} and {shard.url} both map to shard name {shard.name!r}; rename one")
        if first is not None:
            raise JobError(
                f"input files {first.url} and {shard.url} map to shard names {first.name!r} and "
                f"{shard.name!r}, which differ only in letter case: on a case-insensitive output "
                "filesystem they would share one set of output files; rename one"
            )
        by_folded[shard.name.lower()] = shard
    return sorted(shards, key=lambda s: s.name)


# A path with a query naming one object's version (s3fs's `?versionId=`): a query has a
# `name=value` and no `/`, and the path before it no glob character (`part-0?.parquet` is a glob).
_QUERY_PATH = re.compile(r"[^*?\[]+\?[^/?]*=[^/]*")


def _one_file_shard(fs: fsspec.AbstractFileSystem, path: str, uri: str, data_format: str) -> Shard:
    """The one shard of an http(s) URL or a path with a query (see the module's note)."""
    # A URL is its own full name (fsspec's unstrip_protocol would prefix `HTTP://...` with `http://`)
    shown = redact_query(path if isinstance(fs, SignedURLFileSystem) else fs.unstrip_protocol(path))
    suffixes, kind = FORMAT_FILES[data_format]
    file_name = url_file_name(path)
    if not file_name.lower().endswith(suffixes):
        raise ConfigError(
            "data.uri",
            f"{shown}: a URL is read as one file, and {file_name!r} (its path's last part) does not end in "
            f"{' or '.join(suffixes)} (data.format={data_format})",
        )
    try:
        info = fs.info(path)
    except URLStatusError as e:
        if 400 <= e.status < 500:
            raise ConfigError("data.uri", f"{e}{e.hint}") from None
        raise JobError(f"data.uri: cannot read {e}") from None
    except FileNotFoundError:
        raise ConfigError("data.uri", f"nothing found at {shown}") from None
    except ValueError as e:  # fsspec refusing the path (s3fs: a versionId without version_aware)
        raise ConfigError("data.uri", f"{shown}: {one_line(e)}") from None
    except (OSError, aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise JobError(f"data.uri: cannot read {shown}: {one_line(e)}") from None
    return Shard(shard_name(file_name, ""), path, shown, info.get("size"), _version(info))


def one_line(error: BaseException) -> str:
    """The error as one short line; an http(s) URL in it (aiohttp's errors name the signed URL
    they were refused) loses its query."""
    text = redact_query(" ".join(str(error).split()) or type(error).__name__)
    return text if len(text) < 300 else text[:297] + "..."


def shard_name(path: str, root: str) -> str:
    """The shard's name: its relative path as a plain file name, or a slug and a hash when that is
    not safe (see the module docstring). Always matches _SAFE_NAME and fits NAME_MAX_BYTES."""
    rel = posixpath.relpath(path, root) if root else path
    stem = rel[: -len(posixpath.splitext(rel)[1]) or None]
    plain = stem.replace("/", "__")
    if _SAFE_NAME.fullmatch(plain) and len(plain) <= NAME_MAX_BYTES and plain not in (".", ".."):
        return plain
    slug = _UNSAFE.sub("_", plain).strip("._=-")[: NAME_MAX_BYTES - 12] or "shard"
    return f"{slug}-{hashlib.sha256(rel.encode('utf-8', 'surrogateescape')).hexdigest()[:10]}"


def is_safe_name(name: str) -> bool:
    """True for names shard_name can produce: a plain file name that cannot leave its directory."""
    return bool(_SAFE_NAME.fullmatch(name)) and len(name.encode()) <= NAME_MAX_BYTES


def previous_run_shards(fs: fsspec.AbstractFileSystem, path: str, uri: str) -> Optional[list[Shard]]:
    """The committed results files of the run whose output directory is `path`, one shard each
    (see the module's note); None when `path` is no run's output directory."""
    commits = posixpath.join(path, "_commits")
    try:
        if not fs.isdir(commits):
            return None
        fs.invalidate_cache(commits)
        names = sorted(posixpath.basename(p) for p in fs.ls(commits, detail=False))
    except (OSError, PermissionError) as e:
        raise JobError(f"data.uri: cannot list {uri}: {e}") from None
    shards = []
    for file_name in names:
        name = file_name[: -len(".json")]
        if not file_name.endswith(".json") or not is_safe_name(name):
            continue
        shard = _committed_shard(fs, path, name)
        if shard is not None:
            shards.append(shard)
    if not shards:
        raise ConfigError("data.uri", f"{uri} is a run's output directory with no committed shard yet")
    log.info("data.uri: %s is a run's output directory: its %d committed shard(s)", uri, len(shards))
    return shards


def _committed_shard(fs: fsspec.AbstractFileSystem, run_dir: str, name: str) -> Optional[Shard]:
    """The results file of shard `name` that the run at `run_dir` committed (its `_commits/`
    marker): the published file, or the attempt's while its publication is pending; None when
    there is no readable marker with results."""
    try:
        marker = json.loads(fs.cat_file(posixpath.join(run_dir, "_commits", f"{name}.json")))
    except (OSError, ValueError):
        return None  # vanished or torn: not a committed shard that could be read
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(marker, dict) or (isinstance(files, list) and "results.parquet" not in files):
        return None  # not a marker, or one without results (a marker without "files" has them)
    results = posixpath.join(run_dir, "results", f"{name}.parquet")
    attempt_dir = marker.get("attempt_dir")
    if not fs.exists(results) and isinstance(attempt_dir, str):  # its publication is pending
        results = posixpath.join(run_dir, *attempt_dir.split("/"), "results.parquet")
    try:
        info = fs.info(results)
    except FileNotFoundError:
        return None
    return Shard(name, results, fs.unstrip_protocol(results), info.get("size"), _version(info))


def refreshed(shard: Shard, fs: fsspec.AbstractFileSystem) -> Shard:
    """`shard` with the size and version its file has now: what an attempt that opens it reads,
    and so what its commit must be fingerprinted with (a listing or `_plan.json` may be older).
    A previous run's shard listed while its publication was pending pointed into that run's
    `_attempts/`; published since, it is read from where its marker says now."""
    fs.invalidate_cache(posixpath.dirname(shard.path))
    try:
        info = fs.info(shard.path)
    except FileNotFoundError:
        run_dir, sep, _ = shard.path.partition("/_attempts/")
        moved = _committed_shard(fs, run_dir, shard.name) if sep else None
        if moved is None or moved.path == shard.path:
            raise
        return moved
    except URLStatusError as e:  # a signed URL that expired since the listing, a 5xx
        raise ShardError(f"cannot read {e}{e.hint}") from None
    return dataclasses.replace(shard, size=info.get("size"), version=_version(info))


def _version(info: Mapping[str, Any]) -> Optional[str]:
    for key in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "Last-Modified", "created"):
        value = info.get(key)
        if value is not None:
            # One spelling whether a listing or info() gave it (memory:// gives a float in one, a
            # datetime in the other): a version must compare equal to itself.
            return f"{key}={value.timestamp() if isinstance(value, dt.datetime) else value}"
    return None


def _glob_root(pattern: str) -> str:
    parts = pattern.split("/")
    fixed = [p for p in parts[: next(i for i, p in enumerate(parts) if _GLOB_CHARS.search(p))]]
    return "/".join(fixed)


def _is_hidden(rel_path: str) -> bool:
    """Spark's _SUCCESS, checksums and our own temporary files start with '_' or '.'."""
    return any(part.startswith(("_", ".")) for part in rel_path.split("/"))


# Where each scheduler says which worker this process is, innermost first: a launcher started inside
# another one knows the finer split (torchrun under srun, a Ray actor on a Slurm node), so the first
# source found is the one used and the outer ones' variables are not read.
#   batchrun's launchers  BATCHRUN_RANK + BATCHRUN_WORLD_SIZE (set for each worker; BATCHRUN_LAUNCHER
#                         names it, e.g. ray)
#   torchrun              RANK + WORLD_SIZE
#   Slurm                 array task x step task: (SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN) /
#                         SLURM_ARRAY_TASK_STEP of SLURM_ARRAY_TASK_COUNT, times SLURM_PROCID of SLURM_NTASKS
#   Kubernetes Indexed Job  JOB_COMPLETION_INDEX, world size from launcher.world_size or
#                         BATCHRUN_WORLD_SIZE (Kubernetes does not tell a pod the Job's completions)
#   BATCHRUN_WORLD_SIZE alone  the world size for a launcher.rank; without one it is refused
K8S_INDEX = "JOB_COMPLETION_INDEX"


def resolve_worker(config: LauncherConfig, env: Mapping[str, str]) -> Worker:
    """This worker's rank and world size: launcher.rank and launcher.world_size when both are set
    (nothing else is read), else the innermost scheduler's variables (above), else 0 of 1.

    A value set once in the config and once by the environment must agree: launcher.world_size=4
    under WORLD_SIZE=8 is a ConfigError naming both, as is a Kubernetes index with no world size or
    two world sizes. The worker's device is the GPU(s) CUDA_VISIBLE_DEVICES gives it (a launcher
    sets one per worker), recorded in its manifest."""
    device = env.get("CUDA_VISIBLE_DEVICES") or None
    if config.rank is not None and config.world_size is not None:
        return _checked(Worker(config.rank, config.world_size, "config", device))
    found = _worker_from_env(env, config.world_size, config.rank)
    if found is None:
        rank = config.rank if config.rank is not None else 0
        world = config.world_size if config.world_size is not None else 1
        source = "config" if config.rank is not None or config.world_size is not None else "default"
        return _checked(Worker(rank, world, "default" if source == "default" else "config+default", device))
    rank, world, source, keys = found
    for key, mine, theirs, their_key in (
        ("launcher.rank", config.rank, rank, keys[0]),
        ("launcher.world_size", config.world_size, world, keys[1]),
    ):
        if mine is not None and mine != theirs:
            raise ConfigError(
                key,
                f"{key}={mine} contradicts {their_key}={theirs} ({source}); set it only one way, or set both "
                "launcher.rank and launcher.world_size to ignore the environment",
            )
    return _checked(Worker(rank, world, source, device))


def _checked(worker: Worker) -> Worker:
    if worker.world_size < 1:
        raise ConfigError("launcher.world_size", f"must be >= 1, got {worker.world_size} (from {worker.source})")
    if not 0 <= worker.rank < worker.world_size:
        raise ConfigError(
            "launcher.rank", f"must be in [0, {worker.world_size}), got {worker.rank} (from {worker.source})"
        )
    return worker


def _worker_from_env(
    env: Mapping[str, str], config_world: Optional[int], config_rank: Optional[int] = None
) -> Optional[tuple[int, int, str, tuple[str, str]]]:
    """(rank, world size, source, (the rank's variable, the world size's)) of the innermost
    scheduler whose variables are set, or None."""

    def num(name: str, default: Optional[int] = None) -> int:
        value = env.get(name)
        if value is None or value == "":
            if default is None:
                raise ConfigError("launcher", f"{name} is not set but its partner variables are")
            return default
        try:
            return int(value)
        except ValueError:
            raise ConfigError("launcher", f"environment variable {name}={value!r} is not an integer") from None

    if "BATCHRUN_RANK" in env:
        label = env.get("BATCHRUN_LAUNCHER") or "batchrun"
        source = f"{label} launcher BATCHRUN_RANK/WORLD_SIZE"
        return num("BATCHRUN_RANK"), num("BATCHRUN_WORLD_SIZE"), source, ("BATCHRUN_RANK", "BATCHRUN_WORLD_SIZE")
    if "RANK" in env and "WORLD_SIZE" in env:
        return num("RANK"), num("WORLD_SIZE"), "torchrun RANK/WORLD_SIZE", ("RANK", "WORLD_SIZE")
    slurm = "SLURM_ARRAY_TASK_ID" in env or "SLURM_PROCID" in env
    if slurm and K8S_INDEX in env:
        raise ConfigError("launcher", f"both Slurm (SLURM_*) and Kubernetes ({K8S_INDEX}) variables are set; unset one")
    if slurm:
        rank, world, sources = 0, 1, []
        if "SLURM_ARRAY_TASK_ID" in env:
            step = num("SLURM_ARRAY_TASK_STEP", 1)
            rank = (num("SLURM_ARRAY_TASK_ID") - num("SLURM_ARRAY_TASK_MIN", 0)) // step
            world = num("SLURM_ARRAY_TASK_COUNT")
            sources.append("SLURM_ARRAY_TASK_ID/COUNT")
        if "SLURM_PROCID" in env:
            # Each array task may itself run several tasks (srun): ranks nest as array x tasks.
            num_tasks = num("SLURM_NTASKS", 1)
            rank, world = rank * num_tasks + num("SLURM_PROCID"), world * num_tasks
            sources.append("SLURM_PROCID/NTASKS")
        return (
            rank,
            world,
            " + ".join(sources),
            ("SLURM_ARRAY_TASK_ID/SLURM_PROCID", "SLURM_ARRAY_TASK_COUNT/SLURM_NTASKS"),
        )
    if K8S_INDEX in env:
        env_world = num("BATCHRUN_WORLD_SIZE") if env.get("BATCHRUN_WORLD_SIZE") else None
        if config_world is not None and env_world is not None and config_world != env_world:
            raise ConfigError(
                "launcher.world_size",
                f"launcher.world_size={config_world} contradicts BATCHRUN_WORLD_SIZE={env_world}; set one",
            )
        k8s_world = config_world if config_world is not None else env_world
        if k8s_world is None:
            raise ConfigError(
                "launcher.world_size",
                f"{K8S_INDEX} is set (a Kubernetes Indexed Job) but the world size is not: set "
                "launcher.world_size or BATCHRUN_WORLD_SIZE to the Job's completions",
            )
        where = "launcher.world_size" if config_world is not None else "BATCHRUN_WORLD_SIZE"
        return num(K8S_INDEX), k8s_world, f"Kubernetes {K8S_INDEX} + {where}", (K8S_INDEX, where)
    if env.get("BATCHRUN_WORLD_SIZE"):
        # A world size alone (a Job not in Indexed mode, a variable left exported): each process
        # would run as 0 of 1, so the rank must come from the config or it is refused.
        world = num("BATCHRUN_WORLD_SIZE")
        if config_rank is None:
            raise ConfigError(
                "launcher.rank",
                f"BATCHRUN_WORLD_SIZE={world} is set but nothing gives this worker's rank (BATCHRUN_RANK, "
                f"{K8S_INDEX} of an Indexed Job, launcher.rank); set one or unset BATCHRUN_WORLD_SIZE",
            )
        return config_rank, world, "launcher.rank + BATCHRUN_WORLD_SIZE", ("launcher.rank", "BATCHRUN_WORLD_SIZE")
    return None


def assign_shards(shards: Sequence[Shard], worker: Worker) -> list[Shard]:
    """This worker's shards: round-robin over shards sorted by name."""
    return sorted(shards, key=lambda s: s.name)[worker.rank :: worker.world_size]
