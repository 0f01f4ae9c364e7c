"""Credentials out of everything batchrun writes or logs.

The output directory (commit markers, `_plan.json`, manifests, claims) often sits in a bucket
others can list, and log lines end up in shared job logs; neither may carry a credential the user
passed in a URL or a storage option. Two functions do all of it, so that every writer applies the
same rules:

- `redact_text(s)`: a string with the password of every `scheme://user:password@` URL, every
  credential query parameter (presigned S3/GCS URLs, Azure SAS tokens, `token=`, `access_token=`,
  ...), every secret field of a connection string (`AccountKey=...;`) and every Authorization /
  Cookie header value replaced by REDACTED. What is left (host, path, user name, expiry) still
  tells a reader which resource was meant.
- `redact(document)`: a copy of a JSON-like document with, inside every `storage_options` (at any
  depth), the values of credential-like keys replaced, and every string anywhere passed through
  `redact_text`.

`redact_query(text)` goes further for text that names a signed http(s) URL (an input read over
HTTP): every such URL's whole query becomes REDACTED, whatever its parameters are called, since a
signed URL's query is the grant as a whole and its names vary by issuer.

Both are idempotent (redacting twice gives the same text), so a document may pass through several
writers; whoever compares a redacted document with a fresh one must redact both sides.
"""

from __future__ import annotations

import logging
import re
from typing import Any

REDACTED = "<redacted>"

# Keys inside storage_options (at any depth) whose values are credentials.
_SECRET_WORDS = (
    "secret",
    "token",
    "password",
    "passwd",
    "passphrase",
    "credential",
    "key",
    "auth",
    "signature",
    "sas",
    "cookie",
    "connection_string",
)
_NOT_SECRET = {"anon", "use_ssl", "endpoint_url", "region_name", "requester_pays"}

# scheme://user:password@host (also scheme:///user:password@ as memory:// writes its paths).
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*:///?[^/\s:@?#'\"]*):([^/\s@?#'\"]*)@")
# The same in an fsspec path, which has lost its scheme but kept the userinfo (a Shard's `path`):
# only at the very start of the string, where "user:password@host/" cannot be prose.
_PATH_USERINFO = re.compile(r"^(/?[^/\s:@?#'\"]+):([^/\s@?#'\"]*)@(?=[^/\s@]+/)")
# Query parameters that carry a credential: presigned S3 (X-Amz-*), GCS (X-Goog-*), Azure SAS
# (sig; sv, se and the other SAS fields only describe the grant), OAuth and API tokens, and the
# signed URLs of other stores and CDNs: Alibaba OSS (x-oss-*), Tencent COS (q-signature), Backblaze
# B2 (Authorization), Cloudflare (verify), Akamai (hdnts, __token__, hmac).
_QUERY_NAMES = (
    r"x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|x-goog-credential"
    r"|signature|sig|token|access_token|id_token|refresh_token|auth|api_key|apikey|key|code|password"
    r"|secret|client_secret|awsaccesskeyid|security-token|x-ms-copy-source-authorization|q-signature"
    r"|x-oss-signature|x-oss-credential|x-oss-security-token|authorization|verify|hdnts|__token__|hmac"
)
_QUERY = re.compile(rf"(?i)([?&;](?:{_QUERY_NAMES})=)([^&#\s'\"]*)")
# Connection strings (Azure storage and Service Bus, ODBC-style): Name=value;...
_CONNECTION = re.compile(
    r"(?i)\b((?:AccountKey|SharedAccessSignature|SharedAccessKey|Password|Pwd|ClientSecret)=)([^;'\"]*)"
)
# Header values in text (a header list, a repr of a headers dict): "Authorization: Bearer x",
# "'Cookie': 'a=b'".
_HEADER = re.compile(
    r"(?i)\b((?:proxy-)?authorization|cookie|set-cookie|x-api-key)(['\"]?\s*[:=]\s*)(['\"]?)"
    r"((?:bearer|basic|token|digest)\s+)?([^'\"\r\n,}]*)"
)


def redact_text(text: str) -> str:
    """`text` with the credentials a URL, connection string or header text can carry replaced."""
    if not text:
        return text
    text = _USERINFO.sub(lambda m: f"{m.group(1)}:{REDACTED}@", text)
    text = _PATH_USERINFO.sub(lambda m: f"{m.group(1)}:{REDACTED}@", text)
    text = _CONNECTION.sub(lambda m: m.group(1) + REDACTED, text)
    text = _QUERY.sub(lambda m: m.group(1) + REDACTED, text)
    return _HEADER.sub(lambda m: m.group(1) + m.group(2) + m.group(3) + (m.group(4) or "") + REDACTED, text)


# An http(s) URL's query, up to where the URL ends in prose, a repr or a log line; not one that is
# REDACTED already (idempotence).
_URL_QUERY = re.compile(r"(?i)\b(https?://[^\s?#'\"<>]+)\?(?!" + re.escape(REDACTED) + r")[^\s#'\"<>]+")


def redact_query(text: str) -> str:
    """`text` redacted as by redact_text, and with the whole query of every http(s) URL in it
    replaced by REDACTED (the fragment, which is never sent, is kept)."""
    return redact_text(_URL_QUERY.sub(lambda m: f"{m.group(1)}?{REDACTED}", text)) if text else text


def redact(document: Any, inside_options: bool = False) -> Any:
    """A copy of `document` (dicts, lists, scalars) with credential-like values of every
    `storage_options` replaced and every string redacted by redact_text. Keys are kept. A `uri`,
    `*_uri` or `path` value (data.uri, output.uri, a plan's data_uri, a shard's path in `_plan.json`, the
    signed URL itself for an http(s) input) is redacted by redact_query: an
    http(s) input's query is a grant whatever its parameters are called, as its shard's url says."""
    if isinstance(document, dict):
        out = {}
        for key, value in document.items():
            name = str(key).lower()
            if (
                inside_options
                and not isinstance(value, (dict, list, tuple))
                and value not in (None, "")
                and name not in _NOT_SECRET
                and any(w in name for w in _SECRET_WORDS)
            ):
                out[key] = REDACTED
            elif (name in ("uri", "path") or name.endswith("_uri")) and isinstance(value, str):
                out[key] = redact_query(value)
            else:
                out[key] = redact(value, inside_options or name == "storage_options")
        return out
    if isinstance(document, (list, tuple)):
        return [redact(v, inside_options) for v in document]
    if isinstance(document, str):
        return redact_text(document)
    return document


class RedactFilter(logging.Filter):
    """Redacts each record's message, arguments and traceback text before any handler formats it.

    The message is formatted here (`getMessage()`), because an argument may be anything whose
    str() carries a URL (an exception, a config object); the record leaves with the redacted text
    and no arguments. Attach it to handlers: a logger's filters see only records logged on that
    very logger, not those of its children.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: let the handler report it as logging does
            return True
        # redact_query: a log line may name a signed input's URL (an aiohttp error's url='...')
        record.msg, record.args = redact_query(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_query(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_query(record.stack_info)
        return True
