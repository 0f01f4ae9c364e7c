"""The planner: every request once, shared prefixes adjacent, input order restored, output unchanged."""

from __future__ import annotations

import dataclasses
import random

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from batchrun import cli
from batchrun.engine import EngineRequest, SamplingParams
from batchrun.job import DataConfig, JobConfig, ModelConfig, OutputConfig, RunConfig, run_job
from batchrun.job.config import config_fields
from batchrun.job.formats.writer import ResultWriter
from batchrun.job.run.planner import PlannerConfig, plan_order, plan_requests

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_torch_thread")]


ORDERS = ["longest_first", "shortest_first", "input"]
BLOCK = 4

# Prompts built from a few shared heads so that prefixes are shared at several depths.
_heads = st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12])
_prompts = st.lists(
    st.tuples(_heads, st.lists(st.integers(0, 3), max_size=10)).map(lambda t: t[0] + t[1]).filter(bool),
    min_size=0,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(
    prompts=_prompts,
    order=st.sampled_from(ORDERS),
    window=st.integers(1, 50),
    enabled=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_every_request_comes_out_once_and_the_writer_restores_input_order(prompts, order, window, enabled, seed):
    requests = [EngineRequest(request_id=i, prompt=p) for i, p in enumerate(prompts)]
    planned = list(plan_requests(iter(requests), PlannerConfig(enabled=enabled, order=order, window=window), BLOCK))
    assert sorted(r.request_id for r in planned) == list(range(len(prompts)))
    assert all(requests[r.request_id] is r for r in planned)
    if not enabled:
        assert planned == requests
    # Finishing order is the engine's business: the planned order, then shuffled a little.
    finished = [r.request_id for r in planned]
    rng = random.Random(seed)
    for _ in range(len(finished) // 2):
        i, j = rng.randrange(len(finished)), rng.randrange(len(finished))
        finished[i], finished[j] = finished[j], finished[i]
    fs = fsspec.filesystem("memory")
    path = f"/planner-{seed}-{len(prompts)}.parquet"
    schema = pa.schema([pa.field("id", pa.string())])
    writer = ResultWriter(fs, path, schema)
    for index in finished:
        writer.put(index, {"id": f"row{index}"})
    assert writer.close() == len(prompts)
    with fs.open(path, "rb") as f:
        assert pq.read_table(f).column("id").to_pylist() == [f"row{i}" for i in range(len(prompts))]
    fs.rm(path)


@settings(max_examples=150, deadline=None)
@given(prompts=_prompts, order=st.sampled_from(ORDERS))
def test_prompts_sharing_full_blocks_are_contiguous(prompts, order):
    planned = plan_order(prompts, order, BLOCK)
    assert sorted(planned) == list(range(len(prompts)))
    position = {index: pos for pos, index in enumerate(planned)}
    for p in prompts:
        for k in range(1, len(p) // BLOCK + 1):
            head = p[: k * BLOCK]
            where = sorted(position[i] for i, q in enumerate(prompts) if q[: k * BLOCK] == head)
            assert where == list(range(where[0], where[0] + len(where))), (head, planned)


def test_orders_on_an_example():
    instruction_a, instruction_b = [1] * 32, [2] * 32
    prompts = [
        [9, 9, 9],  # 0: short, shares nothing
        instruction_a + [5] * 3,  # 1
        instruction_b + [6] * 50,  # 2: the longest
        instruction_a + [7] * 20,  # 3
        instruction_b + [8] * 2,  # 4
        [3] * 40,  # 5
    ]
    # Groups (by instruction) stay together; groups and prompts within them ordered by length.
    assert plan_order(prompts, "longest_first", 16) == [2, 4, 3, 1, 5, 0]
    assert plan_order(prompts, "shortest_first", 16) == [0, 4, 2, 1, 3, 5]
    assert plan_order(prompts, "input", 16) == [0, 1, 3, 2, 4, 5]
    # Prompts that extend one another (conversations) make a deep trie: no recursion limit.
    chain = [list(range(k)) for k in range(1, 1200)]
    assert plan_order(chain, "longest_first", 1) == list(range(len(chain)))[::-1]


def test_planner_yaml_lists_every_key_and_the_default_is_longest_first():
    node = yaml.safe_load((cli.CONF_DIR / "planner" / "default.yaml").read_text())
    assert sorted(node) == sorted(config_fields("planner")) == sorted(f.name for f in dataclasses.fields(PlannerConfig))
    cfg = cli.load_config([])
    assert cfg.planner == PlannerConfig() and cfg.planner.order == "longest_first" and cfg.planner.enabled
    assert cli.load_config(["planner.order=input", "planner.window=8"]).planner == PlannerConfig(
        order="input", window=8
    )
    with pytest.raises(cli.ConfigError, match="planner.order"):
        cli.load_config(["planner.order=random"])


class _RecordingEngine:
    """The real engine, with the order in which requests (row indices of the one shard) reach it recorded."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.admitted: list[int] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def stream(self, requests, *args, **kwargs):
        def record():
            for r in requests:
                if r is not None:  # None: the job has nothing to admit right now
                    shard_key, row_index = r.request_id
                    self.admitted.append(row_index)
                yield r

        return self._engine.stream(record(), *args, **kwargs)


def test_greedy_output_is_the_same_with_the_planner_on_and_off(tmp_path, short_texts, tiny_engine, tiny_llama_dir):
    rng = random.Random(0)
    texts = [t[: rng.randrange(40, len(t))] for t in short_texts[:14]]
    # Two instructions shared by several rows each, interleaved with rows that share nothing.
    instruction = "Answer in one line. " * 6
    other = "List the keywords you see. " * 5
    texts += [instruction + t[:30] for t in short_texts[14:19]] + [other + t[:50] for t in short_texts[19:23]]
    order = list(range(len(texts)))
    rng.shuffle(order)
    texts = [texts[i] for i in order]
    ids = [f"row{i:02d}" for i in range(len(texts))]
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": ids, "text": texts}), tmp_path / "in" / "part-00.parquet", row_group_size=7)

    outputs, admitted = {}, {}
    for name, planner in [
        ("off", PlannerConfig(enabled=False)),
        ("longest_first", PlannerConfig()),
        ("shortest_first_window_10", PlannerConfig(order="shortest_first", window=10)),
    ]:
        engine = _RecordingEngine(tiny_engine)
        cfg = RunConfig(
            job=JobConfig(name="generate", chat_template="never"),
            model=ModelConfig(path=tiny_llama_dir),
            sampling=SamplingParams(temperature=0.0, max_tokens=6),
            data=DataConfig(uri=str(tmp_path / "in"), batch_size=5),
            output=OutputConfig(uri=str(tmp_path / name)),
            planner=planner,
            quiet=True,
        )
        result = run_job(cfg, engine=engine)
        assert result.exit_code == 0
        rows = pq.read_table(tmp_path / name / "results" / "part-00.parquet").to_pylist()
        assert [r["id"] for r in rows] == ids  # input order, whatever the admission order
        assert all(r["error_type"] is None for r in rows)
        outputs[name] = [(r["output"], r["num_output_tokens"]) for r in rows]
        admitted[name] = engine.admitted

    assert outputs["longest_first"] == outputs["off"] == outputs["shortest_first_window_10"]
    assert admitted["off"] == list(range(len(texts)))
    planned = admitted["longest_first"]
    assert sorted(planned) == list(range(len(texts))) and planned != admitted["off"]
    for head in (instruction, other):  # rows sharing an instruction reach the engine back to back
        where = sorted(planned.index(i) for i, t in enumerate(texts) if t.startswith(head))
        assert where == list(range(where[0], where[0] + len(where)))
    # Windows of 10 rows: each window is planned on its own, in input order between windows.
    windowed = admitted["shortest_first_window_10"]
    assert [sorted(windowed[k : k + 10]) for k in range(0, len(texts), 10)] == [
        list(range(k, min(k + 10, len(texts)))) for k in range(0, len(texts), 10)
    ]
