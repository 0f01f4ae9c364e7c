"""Build the bundled sample shards: real English text from CPython's documentation topics.

Run once (`python -m batchrun.data.make_sample`) and commit the result; the files are what
`python -m batchrun job=summarize` reads when `data.uri` is not set. pydoc's topics differ a little
between Python versions, which is why the Parquet files are committed rather than built at run time.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

NUM_SHARDS = 4
DOCS_PER_SHARD = 8
MAX_CHARS = 1500
MIN_DOC_CHARS = 1000  # shorter topics make poor summarization inputs

SCHEMA = pa.schema([("id", pa.string()), ("title", pa.string()), ("text", pa.string())])


def split_title(doc: str) -> tuple[str, str]:
    """pydoc topics start with a title line underlined by '*'; return (title, body)."""
    lines = doc.split("\n")
    if len(lines) > 1 and set(lines[1].strip()) == {"*"}:
        return lines[0].strip(), "\n".join(lines[2:]).strip()
    return lines[0].strip(), doc.strip()


def truncate(text: str, max_chars: int = MAX_CHARS) -> str:
    """Cut at the last paragraph break before max_chars, else the last sentence end."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    cut = head.rfind("\n\n")
    if cut < max_chars // 2:
        ends = [m.end() for m in re.finditer(r"[.!?][\"”)]?\s", head)]
        cut = ends[-1] if ends else max_chars
    return head[:cut].strip()


def sample_rows() -> list[dict[str, str]]:
    from pydoc_data.topics import topics

    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    for name in sorted(topics):
        doc = topics[name]
        if len(doc) < MIN_DOC_CHARS or doc in seen:  # "if" and "else" share one document
            continue
        seen.add(doc)
        title, body = split_title(doc)
        rows.append({"id": f"topic-{name}", "title": title, "text": truncate(body)})
        if len(rows) == NUM_SHARDS * DOCS_PER_SHARD:
            break
    assert len(rows) == NUM_SHARDS * DOCS_PER_SHARD, f"only {len(rows)} topics are long enough"
    return rows


def write_shards(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = sample_rows()
    paths = []
    for i in range(NUM_SHARDS):
        chunk = rows[i * DOCS_PER_SHARD : (i + 1) * DOCS_PER_SHARD]
        path = out_dir / f"topics-{i:02d}.parquet"
        pq.write_table(pa.Table.from_pylist(chunk, schema=SCHEMA), path)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "sample")
    for path in write_shards(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
