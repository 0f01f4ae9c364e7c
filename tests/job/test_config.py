"""The config checker: every key and type of every group, with messages that name the key."""

from __future__ import annotations

import pytest

from batchrun.engine import EngineConfig, SamplingParams
from batchrun.job import ConfigError, RunConfig, build_run_config
from batchrun.job.config import unknown_key


def _raw(**sections) -> dict:
    return {"data": {"uri": "/in"}, **sections}


def test_nested_groups_build_their_dataclass():
    cfg = build_run_config(_raw(engine={"speculative": {"method": "ngram", "ngram_max": 3}}))
    assert cfg.engine.speculative.method == "ngram" and cfg.engine.speculative.ngram_max == 3
    assert cfg.to_dict()["engine"]["speculative"]["ngram_max"] == 3


def test_minimal_config_takes_dataclass_defaults_and_model_path_drives_engine():
    cfg = build_run_config(_raw(model={"path": "/models/x"}, engine={"max_num_seqs": 4}))
    assert isinstance(cfg, RunConfig)
    assert cfg.engine == EngineConfig(model="/models/x", max_num_seqs=4)
    assert cfg.sampling == SamplingParams()
    assert cfg.data.uri == "/in" and cfg.data.id_column == "id"
    assert "model" not in cfg.to_dict()["engine"] and cfg.to_dict()["model"] == {"path": "/models/x"}


def test_values_are_converted_to_the_annotated_types():
    cfg = build_run_config(
        _raw(
            sampling={"stop": ["\n\n"], "stop_token_ids": [1, 2], "temperature": 1},
            engine={"kv_cache_memory": 0.5, "max_model_len": 256},
            output={"uri": "s3://b/out", "keep_columns": ["title"], "storage_options": {"anon": True}},
            launcher={"rank": 1, "world_size": 2},
            quiet=True,
        )
    )
    assert cfg.sampling.stop == ("\n\n",) and cfg.sampling.stop_token_ids == (1, 2)
    assert isinstance(cfg.sampling.temperature, float)
    assert cfg.output.keep_columns == ("title",) and cfg.output.storage_options == {"anon": True}
    assert cfg.quiet is True and cfg.launcher.world_size == 2


@pytest.mark.parametrize(
    "raw, message",
    [
        (_raw(engine={"max_num_seqz": 3}), "engine.max_num_seqz: unknown key (did you mean max_num_seqs?)"),
        (_raw(sampling={"temprature": 0.5}), "sampling.temprature: unknown key (did you mean temperature?)"),
        (_raw(dta={}), "dta: unknown key (did you mean data?)"),
        (_raw(engine={"model": "x"}), "engine.model: set model.path instead"),
        (_raw(engine={"block_size": "many"}), "engine.block_size: expected int, got str 'many'"),
        (_raw(engine={"block_size": True}), "engine.block_size: expected int, got bool True"),
        (_raw(engine={"max_model_len": 1.5}), "engine.max_model_len: expected int or null, got float 1.5"),
        (_raw(sampling={"stop": "x"}), "sampling.stop: expected a list, got str 'x'"),
        (_raw(sampling={"stop_token_ids": ["a"]}), "sampling.stop_token_ids[0]: expected int, got str 'a'"),
        (
            _raw(data={"uri": "/in", "on_too_long": "cut"}),
            "data.on_too_long: must be one of error, truncate; got 'cut'",
        ),
        (_raw(data={"uri": "/in", "storage_options": []}), "data.storage_options: expected a mapping, got list []"),
        (_raw(quiet="yes"), "quiet: expected bool, got str 'yes'"),
        (_raw(engine=3), "engine: expected a mapping of keys, got int 3"),
        (
            _raw(engine={"speculative": {"methd": "ngram"}}),
            "engine.speculative.methd: unknown key (did you mean method?)",
        ),
        (
            _raw(engine={"speculative": {"num_speculative_tokens": "4"}}),
            "engine.speculative.num_speculative_tokens: expected int, got str '4'",
        ),
        # Checks inside the dataclasses surface with their key, too.
        ({"data": {}}, "data.uri: missing"),
        (_raw(engine={"dtype": "fp8"}), "engine.dtype must be float32, bfloat16, float16 or auto, got 'fp8'"),
        (_raw(sampling={"temperature": -1}), "sampling: temperature must be >= 0"),
        (_raw(output={"uri": "o", "keep_columns": ["id"]}), "output.keep_columns: id would overwrite a result column"),
        (_raw(job={"prompt_template": "{0}"}), "job.prompt_template: placeholders must name a column, got {0}"),
        (_raw(job={"prompt_template": "{text"}), "job.prompt_template: not a valid template"),
        (_raw(job={"chat_template": "sometimes"}), "job.chat_template: must be one of auto, always, never"),
    ],
)
def test_bad_config_names_the_key(raw, message):
    with pytest.raises(ConfigError) as info:
        build_run_config(raw)
    assert str(info.value).startswith(message), str(info.value)


def test_unknown_key_suggestions_for_hydra_refusals():
    assert str(unknown_key("engine.max_num_seqz")) == "engine.max_num_seqz: unknown key (did you mean max_num_seqs?)"
    assert str(unknown_key("sampling.zzz")).startswith("sampling.zzz: unknown key (known keys: temperature,")
    assert str(unknown_key("enigne")) == "enigne: unknown key (did you mean engine?)"
    assert str(unknown_key("engine.speculative.methd")) == (
        "engine.speculative.methd: unknown key (did you mean method?)"
    )
    assert str(unknown_key("engine.dtype.x")) == "engine.dtype: is not a group of keys"


def test_speculative_settings_enter_the_fingerprint_only_where_seeded_rows_speculate():
    from batchrun.job.commit.fingerprint import differences, settings_fingerprint

    def fingerprint(**spec) -> dict:
        return settings_fingerprint(build_run_config(_raw(engine={"speculative": spec})))

    adaptive = fingerprint(method="ngram", num_speculative_tokens=2)
    assert adaptive["engine.speculative.seeded_drafts"] is None  # seeded rows never carry drafts
    assert not differences(adaptive, fingerprint(method="ngram", num_speculative_tokens=5))
    forced = fingerprint(method="ngram", num_speculative_tokens=2, adaptive=False)
    (changed,) = differences(adaptive, forced)
    assert changed.startswith("engine.speculative.seeded_drafts: null -> {")
    assert differences(forced, fingerprint(method="ngram", num_speculative_tokens=5, adaptive=False))
