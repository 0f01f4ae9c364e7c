"""A job over the issue's architectures (GPT-NeoX and OLMo 2: the generic path, model/generic.py;
Phi-3 with a plain rope: native): `python -m batchrun job=generate` in process, each row's output
equal to HF's greedy generation, and the manifest saying which path served the model."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.support.generic_models import save_tiny

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MAX_TOKENS = 8
PROMPTS = ["def f(x):", "The list type", "Built-in functions and exceptions are", "a"]


ARCHITECTURES = [
    ("gpt_neox", dict(partial_rotary_factor=0.25), "generic"),
    ("olmo2", dict(num_key_value_heads=2), "generic"),
    ("phi3", dict(num_key_value_heads=2), "native"),
]


@pytest.mark.parametrize("model_type, config, path", ARCHITECTURES, ids=[a[0] for a in ARCHITECTURES])
def test_generate_job_writes_hf_greedy_outputs(tmp_path, one_torch_thread, model_type, config, path):
    from transformers import AutoModelForCausalLM

    from batchrun import cli
    from batchrun.testing import build_tokenizer

    tokenizer = build_tokenizer()
    model_dir = save_tiny(tmp_path / model_type, tokenizer, model_type, **config)
    (tmp_path / "in").mkdir()
    ids = [f"row{i}" for i in range(len(PROMPTS))]
    pq.write_table(pa.table({"id": ids, "prompt": PROMPTS}), tmp_path / "in" / "part-00.parquet")

    overrides = [
        f"model.path={model_dir}",
        f"data.uri={tmp_path / 'in'}",
        f"output.uri={tmp_path / 'out'}",
        "engine.kv_cache_memory=67108864",
        "engine.max_num_seqs=2",
        "engine.max_num_batched_tokens=1024",
        "engine.dtype=float32",
        "engine.num_threads=1",
        "sampling.temperature=0",
        f"sampling.max_tokens={MAX_TOKENS}",
        "quiet=true",
    ]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["job=generate", *overrides])
    assert exit_info.value.code == 0

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = pq.read_table(tmp_path / "out" / "results" / "part-00.parquet").to_pylist()
    assert [r["id"] for r in rows] == ids
    for prompt, row in zip(PROMPTS, rows):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        generated = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        expected = tokenizer.decode(generated[0, len(prompt_ids) :], skip_special_tokens=True)
        assert row["error_type"] is None and row["output"] == expected, (prompt, row)
    assert all(row["num_output_tokens"] == MAX_TOKENS for row in rows), "every row generated its tokens"
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["status"] == "completed"
    assert manifest["engine_settings"].get("model_path", "native") == path  # absent for a native family
    assert manifest["engine_settings"]["model_type"] == model_type
