"""Checks of one input row before it runs, shared by a run (flow.py, formats.py), a dry run
(dry_run.py) and Ray Data (integrations/ray_data.py), so that all count the same error rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

from batchrun.engine import SamplingParams
from batchrun.job.formats.prompts import Prompt
from batchrun.job.formats.reader import InputRow

DUPLICATE_ID = "duplicate_id"
NULL_ID = "null_id"
INVALID_TEXT = "invalid_text"
INVALID_SCHEMA = "invalid_schema"
UNKNOWN_ADAPTER = "unknown_adapter"


def id_key(row_id: Any) -> Any:
    """A hashable key for an id of any Arrow type (lists and structs come back as lists and dicts)."""
    try:
        hash(row_id)
        return (type(row_id).__name__, row_id)
    except TypeError:
        return repr(row_id)


def check_row(row: InputRow, seen_ids: set[Any], id_column: Optional[str]) -> Optional[Prompt]:
    """Errors of the row itself, before any prompt is built: its text and its id. `seen_ids` holds
    the id keys of the shard's earlier rows and gains this row's. The one check of a real run and
    of a dry run (dry_run.py), so both count the same error rows."""
    if row.invalid_columns:
        return Prompt(
            error_type=INVALID_TEXT,
            error_message=(
                f"row {row.index} (id {row.id!r}): column(s) {', '.join(map(repr, row.invalid_columns))} hold text "
                "that is not valid UTF-8"
            ),
        )
    if row.id is None:
        return Prompt(error_type=NULL_ID, error_message=f"row {row.index}: column {id_column!r} is null or NaN")
    key = id_key(row.id)
    if key in seen_ids:
        return Prompt(error_type=DUPLICATE_ID, error_message=f"id {row.id!r} already appeared earlier in this shard")
    seen_ids.add(key)
    return None


def row_adapter(
    row: InputRow, column: Optional[str], known: Mapping[str, Any]
) -> tuple[Optional[str], Optional[Prompt]]:
    """(the row's adapter, None), None for the base model (no column, a null or empty value), or
    (the value as a name where it is text, its unknown_adapter error) when `known` (the keys of
    model.lora_adapters) does not have it."""
    value = row.values.get(column) if column is not None else None
    if value is None or value == "":
        return None, None
    names = ", ".join(sorted(known)) or "none"
    if not isinstance(value, str):
        message = f"column {column!r} holds {type(value).__name__} {value!r}; expected an adapter name (known: {names})"
        return None, Prompt(error_type=UNKNOWN_ADAPTER, error_message=message)
    if value not in known:
        message = f"unknown adapter {value!r} in column {column!r} (known: {names}; null or empty: the base model)"
        return value, Prompt(error_type=UNKNOWN_ADAPTER, error_message=message)
    return value, None


def with_row_schema(
    row: InputRow, params: SamplingParams, schema_column: Optional[str]
) -> tuple[Optional[SamplingParams], Optional[str]]:
    """(params, None), or (None, why the row's schema is invalid): a schema in data.schema_column
    replaces any constraint of the job's for that row. Params unchanged come back as given."""
    schema = row.values.get(schema_column) if schema_column is not None else None
    if schema is None:
        return params, None
    if not isinstance(schema, str):
        return None, f"column {schema_column!r} holds {type(schema).__name__}; expected JSON Schema text"
    try:  # SamplingParams checks the schema: invalid JSON or not compilable
        return dataclasses.replace(params, json_schema=schema, regex=None, choice=()), None
    except ValueError as e:
        return None, f"column {schema_column!r}: {e}"
