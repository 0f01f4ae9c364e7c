"""LoRA adapters chosen per row in a job (model.lora_adapters + data.adapter_column): each row's
output equals HF greedy on its PEFT adapter merged into the tiny Llama (float32), a row naming an
unknown adapter is a typed error row while the rest of the shard runs, the adapters' files are part
of the run's fingerprint, and every misconfiguration stops the run with one line (exit 2)."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batchrun.engine import EngineConfig, SamplingParams
from batchrun.job import ConfigError, DataConfig, JobConfig, ModelConfig, OutputConfig, RunConfig, run_job
from batchrun.job.commit.store import RunStore
from batchrun.job.config import build_run_config, unknown_key
from batchrun.job.formats.reader import InputRow
from batchrun.job.formats.rows import UNKNOWN_ADAPTER, row_adapter
from batchrun.job.operate.status import main as status_main
from batchrun.job.run import runner
from tests.support.engines import TINY_ENGINE

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 8


def make_adapter(base_dir: str, out_dir, seed: int, r: int = 4, targets=TARGETS) -> str:
    """A PEFT LoRA adapter of the model at `base_dir`, saved as PEFT saves it; lora_B drawn
    non-zero (PEFT initializes it to zero: a no-op adapter would prove nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def merged_greedy(base_dir: str, adapter_dir, prompts: list[list[int]]) -> list[list[int]]:
    """HF greedy tokens of the base model, or of `adapter_dir` merged into it (merge_and_unload)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model.eval()
    out = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=model.config.eos_token_id
            )
        out.append(gen[0, len(ids) :].tolist())
    return out


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "alpha": make_adapter(tiny_llama_dir, root / "alpha", seed=1),
        # a second shape of adapter: attention only, another rank
        "beta": make_adapter(tiny_llama_dir, root / "beta", seed=2, r=8, targets=["q_proj", "v_proj", "o_proj"]),
    }


def lora_config(base_dir: str, data, out, adapters: dict[str, str], **output) -> RunConfig:
    return RunConfig(
        job=JobConfig(name="lora", chat_template="never"),
        model=ModelConfig(path=base_dir, lora_adapters=adapters),
        engine=EngineConfig(model=base_dir, max_loras=2, tune_kernels=False, **TINY_ENGINE),
        sampling=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        data=DataConfig(uri=str(data), adapter_column="adapter"),
        output=OutputConfig(uri=str(out), **output),
        quiet=True,
    )


ROWS = [  # (id, the row's adapter)
    ("r0", "alpha"),
    ("r1", "beta"),
    ("r2", None),
    ("r3", "gamma"),  # not a key of model.lora_adapters
    ("r4", ""),
    ("r5", "beta"),
    ("r6", "alpha"),
]


def test_rows_of_two_adapters_and_none_get_their_merged_models_output(
    tmp_path, tiny_llama_dir, adapters, short_texts, capsys
):
    data = tmp_path / "in"
    data.mkdir()
    texts = [short_texts[i][:120] for i in range(len(ROWS))]
    table = pa.table({"id": [i for i, _ in ROWS], "text": texts, "adapter": [a for _, a in ROWS]})
    pq.write_table(table, data / "part-00.parquet")
    out = tmp_path / "out"
    config = lora_config(tiny_llama_dir, data, out, adapters)
    assert config.engine.lora_adapters == adapters and config.engine.max_loras == 2

    result = run_job(config)  # the engine loads from the config: the adapters reach it through the job
    assert (result.exit_code, [s.status for s in result.shards]) == (0, ["committed"]), result.message
    rows = pq.read_table(out / "results" / "part-00.parquet").to_pylist()
    assert [r["id"] for r in rows] == [i for i, _ in ROWS]
    assert [r["adapter"] for r in rows] == ["alpha", "beta", None, "gamma", None, "beta", "alpha"]
    unknown = rows[3]
    assert (unknown["error_type"], unknown["finish_reason"], unknown["output"]) == (UNKNOWN_ADAPTER, "error", None)
    assert "'gamma'" in unknown["error_message"] and "alpha, beta" in unknown["error_message"]

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompts = [tokenizer.encode(t, add_special_tokens=True) for t in texts]
    expected: dict[int, list[int]] = {}
    for name in (None, "alpha", "beta"):
        picked = [i for i, (_, a) in enumerate(ROWS) if (a or None) == name]
        for i, tokens in zip(
            picked, merged_greedy(tiny_llama_dir, adapters.get(name or ""), [prompts[i] for i in picked])
        ):
            expected[i] = tokens
    for i, want in expected.items():
        assert rows[i]["num_output_tokens"] == len(want), (ROWS[i], rows[i])
        assert rows[i]["output"] == tokenizer.decode(want, skip_special_tokens=True), ROWS[i]
    # the adapters change the text: the oracle is not the base model's three times
    assert len({rows[0]["output"], rows[1]["output"], rows[2]["output"]}) == 3

    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["config"]["model"]["lora_adapters"] == adapters
    assert set(manifest["engine_settings"]["lora"]["adapters"]) == {"alpha", "beta"}
    marker = RunStore(str(out), {}).read_marker("part-00")
    assert marker is not None
    marker_settings = marker["fingerprint"]["settings"]
    # the job hashes the adapters' files before the engine loads, as the engine does
    assert {k: v for k, v in marker_settings.items() if k.endswith(".sha256")} == {
        f"model.lora_adapters.{n}.sha256": sha for n, sha in manifest["engine_settings"]["lora"]["adapters"].items()
    }

    # status and the report read a run whose results carry `adapter`
    assert status_main([str(out), "--json"]) == 0 and (out / "report.html").exists()
    capsys.readouterr()

    # A rerun skips the committed shard without loading anything.
    again = run_job(config)
    assert (again.exit_code, [s.status for s in again.shards]) == (0, ["skipped"])

    # A changed adapter file is a changed run: stopped (output.on_change=error), naming the adapter.
    make_adapter(tiny_llama_dir, adapters["beta"], seed=3, r=8, targets=["q_proj", "v_proj", "o_proj"])
    with pytest.raises(ConfigError, match=r"output.on_change: .*model\.lora_adapters\.beta\.sha256"):
        run_job(config)


def test_every_row_value_but_a_known_name_null_or_empty_is_an_unknown_adapter():
    known = {"a": "/x"}

    def check(value):
        return row_adapter(InputRow(index=0, id="r", values={"ad": value}), "ad", known)

    assert check("a") == ("a", None) and check(None) == (None, None) and check("") == (None, None)
    name, error = check("b")
    assert name == "b" and error.error_type == UNKNOWN_ADAPTER and "unknown adapter 'b'" in error.error_message
    name, error = check(7)
    assert name is None and error.error_type == UNKNOWN_ADAPTER
    assert "holds int 7; expected an adapter name (known: a)" in error.error_message
    assert row_adapter(InputRow(index=0, id="r", values={}), None, known) == (None, None)


def test_misconfigured_adapters_stop_with_one_line_naming_the_keys(tmp_path, adapters):
    base = {"data": {"uri": str(tmp_path)}, "output": {"uri": str(tmp_path / "out")}}

    def refused(**sections) -> str:
        raw = {**base, **{k: {**base.get(k, {}), **v} for k, v in sections.items()}}
        with pytest.raises(ConfigError) as info:
            build_run_config(raw)
        return str(info.value)

    both = "model.lora_adapters, data.adapter_column: set both or neither"
    assert refused(model={"lora_adapters": adapters}).startswith(both)
    assert refused(data={"adapter_column": "adapter"}).startswith(both)
    assert refused(model={"lora_adapters": {"": adapters["alpha"]}}, data={"adapter_column": "a"}).startswith(
        "model.lora_adapters: adapter names must be non-empty strings"
    )
    missing = refused(model={"lora_adapters": {"gone": str(tmp_path / "nope")}}, data={"adapter_column": "a"})
    assert missing.startswith("model.lora_adapters.gone: no directory")
    assert refused(model={"lora_adapters": {"a": 3}}, data={"adapter_column": "a"}).startswith(
        "model.lora_adapters.a: expected the path of a PEFT adapter directory"
    )
    assert refused(engine={"lora_adapters": adapters}) == "engine.lora_adapters: set model.lora_adapters instead"
    # one key of the mapping alone is not a Hydra override of the presets' null: the cli's line says how
    assert str(unknown_key("model.lora_adapters.sql")).startswith("model.lora_adapters: a mapping: set it whole")
    assert refused(model={"lora_adapters": adapters}, data={"adapter_column": "a"}, job={"task": "embed"}).startswith(
        "model.lora_adapters: LoRA adapters serve generation"
    )
    assert refused(data={"format": "openai_batch", "adapter_column": "a"}).startswith("data.adapter_column:")
    # what the engine cannot run beside adapters, named by the key users set
    assert refused(
        model={"lora_adapters": adapters}, data={"adapter_column": "a"}, engine={"tensor_parallel_size": 2}
    ).startswith("model.lora_adapters cannot run with engine.tensor_parallel_size=2")
    # a batch file names its adapter in body.model: no column needed
    ok = build_run_config(
        {**base, "model": {"lora_adapters": adapters}, "data": {**base["data"], "format": "openai_batch"}}
    )
    assert ok.engine.lora_adapters == adapters and "lora_adapters" not in ok.to_dict()["engine"]
    assert "lora_adapters" not in build_run_config(base).to_dict()["model"]  # manifests without adapters unchanged
    # `adapter` is a result column only with adapters: a LoRA run's results read again may keep theirs
    assert build_run_config({**base, "output": {**base["output"], "keep_columns": ["adapter"]}})
    assert refused(
        model={"lora_adapters": adapters}, data={"adapter_column": "a"}, output={"keep_columns": ["adapter"]}
    ).startswith("output.keep_columns: adapter would overwrite")


def test_an_adapter_that_does_not_fit_the_model_is_a_config_error(tmp_path, tiny_llama_dir):
    """The engine's LoraError (an adapter whose modules or shapes do not fit) becomes exit 2 with its line."""
    from safetensors.torch import load_file, save_file

    bad = make_adapter(tiny_llama_dir, tmp_path / "bad", seed=4, targets=["q_proj"])
    weights_path = f"{bad}/adapter_model.safetensors"
    weights = load_file(weights_path)
    key = next(k for k in sorted(weights) if "lora_A" in k)
    weights[key] = torch.zeros(weights[key].shape[0], weights[key].shape[1] + 1)  # one input feature too many
    save_file(weights, weights_path)
    engine_config = EngineConfig(model=tiny_llama_dir, lora_adapters={"bad": bad}, tune_kernels=False, **TINY_ENGINE)
    with pytest.raises(ConfigError) as info:
        runner.load_engine(engine_config)
    message = str(info.value)
    assert message.startswith("model.lora_adapters.bad: ") and "q_proj" in message and "\n" not in message


def test_a_batch_request_names_its_adapter_in_body_model_and_the_dry_run_counts_rows_per_adapter(
    tmp_path, tiny_llama_dir, adapters, short_texts
):
    from batchrun.job.launch.dry_run import format_plan, plan_run

    text = short_texts[0][:100]
    lines = [
        {"custom_id": c, "method": "POST", "url": "/v1/completions", "body": {"model": m, "prompt": text}}
        for c, m in (("on-alpha", "alpha"), ("on-base", tiny_llama_dir), ("on-beta", "beta"), ("other", "gpt-4o"))
    ]
    data = tmp_path / "in"
    data.mkdir()
    (data / "batch.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    config = dataclasses.replace(
        lora_config(tiny_llama_dir, data, out, adapters),
        data=DataConfig(uri=str(data), format="openai_batch"),
    )
    engine = runner.load_engine(config.engine)
    try:
        result = run_job(config, engine=engine)
        assert result.exit_code == 0, result.message
        rows = pq.read_table(out / "results" / "batch.parquet").to_pylist()
        assert [(r["id"], r["adapter"], r["error_type"]) for r in rows] == [
            ("on-alpha", "alpha", None),
            ("on-base", None, None),
            ("on-beta", "beta", None),
            ("other", None, "model_not_found"),  # a model name that is neither the model nor an adapter: as before
        ]
        ids = engine.tokenizer.encode(text, add_special_tokens=True)
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        direct = engine.generate([ids] * 3, greedy, adapters=["alpha", None, "beta"])
        assert [r["output"] for r in rows[:3]] == [o.text for o in direct]
        answers = [json.loads(x) for x in (out / "outputs" / "batch.jsonl").read_text().splitlines()]
        assert [a["response"]["body"]["model"] for a in answers] == ["alpha", tiny_llama_dir, "beta"]

        parquet = tmp_path / "rows"
        parquet.mkdir()
        table = pa.table({"id": [i for i, _ in ROWS], "text": [text] * len(ROWS), "adapter": [a for _, a in ROWS]})
        pq.write_table(table, parquet / "part-00.parquet")
        plan = plan_run(lora_config(tiny_llama_dir, parquet, tmp_path / "never", adapters), engine=engine)
        assert plan.adapter_counts == {"alpha": 2, "beta": 2} and plan.error_counts == {UNKNOWN_ADAPTER: 1}
        assert "adapters:       alpha 2, beta 2 ok result rows; 2 on the base model" in format_plan(plan)
    finally:
        engine.close()


@pytest.mark.parametrize("model", ["smollm2_135m", "llama3_8b"])
def test_the_command_line_sets_the_adapter_mapping_whole(tmp_path, model):
    """README's form, `model.lora_adapters={name: dir, ...}` without Hydra's +, on every generating preset."""
    from batchrun import cli

    (tmp_path / "sql").mkdir()
    (tmp_path / "chat").mkdir()
    overrides = [
        f"model={model}",
        "job=generate",
        "data.uri=/some/prompts",
        "data.adapter_column=adapter",
        f"model.lora_adapters={{sql: {tmp_path / 'sql'}, chat: {tmp_path / 'chat'}}}",
    ]
    config = cli.load_config(overrides)
    assert config.model.lora_adapters == {"sql": str(tmp_path / "sql"), "chat": str(tmp_path / "chat")}
    assert config.engine.lora_adapters == config.model.lora_adapters
    assert cli.load_config([f"model={model}"]).model.lora_adapters == {}
