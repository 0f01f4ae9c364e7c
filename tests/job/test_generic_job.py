"""A job over a model outside the native families (GPT-NeoX: the generic path, model/generic.py):
`python -m batchrun job=generate` in process, each row's output equal to HF's greedy generation,
and the manifest saying which path served the model."""

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


def test_generate_job_on_the_generic_path_writes_hf_greedy_outputs(tmp_path, one_torch_thread):
    from transformers import AutoModelForCausalLM

    from batchrun import cli
    from batchrun.testing import build_tokenizer

    tokenizer = build_tokenizer()
    model_dir = save_tiny(tmp_path / "neox", tokenizer, "gpt_neox", partial_rotary_factor=0.25)
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
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["status"] == "completed"
    assert manifest["engine_settings"]["model_path"] == "generic"
    assert manifest["engine_settings"]["model_type"] == "gpt_neox"
