"""Rows to prompt token ids, or to the typed error that says why not (tiny real tokenizer)."""

from __future__ import annotations

import copy

import pytest

from batchrun.job import ConfigError, DataConfig, JobConfig, JobError
from batchrun.job.formats.prompts import PromptBuilder
from batchrun.job.formats.reader import InputRow
from batchrun.testing import build_tokenizer

TEXT = "Assert statements are a convenient way to insert debugging assertions into a program."


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def plain_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    return tok


def _builder(tokenizer, limit: int = 400, on_too_long: str = "error", **job) -> PromptBuilder:
    return PromptBuilder(JobConfig(**job), DataConfig(uri="/x", on_too_long=on_too_long), tokenizer, limit)


def _row(text, **values) -> InputRow:
    return InputRow(0, "r0", {"text": text, **values})


def test_raw_text_is_tokenized_as_is(plain_tokenizer):
    prompt = _builder(plain_tokenizer).build(_row(TEXT))
    assert prompt.error_type is None and prompt.error_message is None
    assert prompt.token_ids == plain_tokenizer.encode(TEXT) and prompt.num_prompt_tokens == len(prompt.token_ids)


def test_template_over_columns_then_chat_template_with_system_prompt(tokenizer):
    builder = _builder(tokenizer, prompt_template="Title: {title}\n{text}\nTags: {tag}", system_prompt="Be brief.")
    prompt = builder.build(_row(TEXT, title="assert", tag=None))
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Title: assert\n{TEXT}\nTags: "}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tokenizer.decode(prompt.token_ids) == expected
    job = JobConfig(prompt_template="{title} {text} {title}")
    assert job.input_columns(DataConfig(uri="/x", text_column="body")) == ["body", "title"]


def test_chat_template_never_and_auto_without_one(tokenizer, plain_tokenizer):
    for builder in (
        _builder(tokenizer, chat_template="never", system_prompt="S."),
        _builder(plain_tokenizer, system_prompt="S."),
    ):
        assert builder.tokenizer.decode(builder.build(_row(TEXT)).token_ids) == f"S.\n\n{TEXT}"
    with pytest.raises(JobError, match="no chat template"):
        _builder(plain_tokenizer, chat_template="always")


@pytest.mark.parametrize(
    "value, error_type",
    [
        (None, "null_prompt"),
        ("", "empty_prompt"),
        ("  \n\t ", "empty_prompt"),
        (42, "wrong_type"),
        (b"bytes", "wrong_type"),
        ({"role": "user"}, "wrong_type"),
        ([], "empty_prompt"),
        ([{"role": "user", "content": "  "}], "empty_prompt"),
        ([{"role": "user"}], "template_error"),
        (["hello"], "template_error"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "template_error"),
    ],
)
def test_bad_rows_get_typed_errors(tokenizer, value, error_type):
    prompt = _builder(tokenizer).build(_row(value))
    assert prompt.token_ids is None and prompt.error_type == error_type and prompt.error_message


def test_messages_use_the_chat_template_and_need_one(tokenizer, plain_tokenizer):
    messages = [
        {"role": "user", "content": "What is assert?"},
        {"role": "assistant", "content": "A check."},
        {"role": "user", "content": "And pass?"},
    ]
    prompt = _builder(tokenizer, chat_template="never", system_prompt="Be brief.").build(_row(messages))
    assert tokenizer.decode(prompt.token_ids) == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *messages], tokenize=False, add_generation_prompt=True
    )
    failed = _builder(plain_tokenizer).build(_row(messages))
    assert failed.error_type == "template_error" and "no" in failed.error_message


def test_a_template_that_raises_is_a_template_error(tokenizer):
    builder = _builder(tokenizer, prompt_template="First tag: {tags[0]}\n{text}")
    assert builder.build(_row(TEXT, tags=["python"])).error_type is None
    failed = builder.build(_row(TEXT, tags=[]))
    assert failed.error_type == "template_error" and "IndexError" in failed.error_message
    raising = copy.deepcopy(tokenizer)
    raising.chat_template = "{{ raise_exception('roles must alternate') }}"
    failed = _builder(raising).build(_row([{"role": "user", "content": "hi"}]))
    assert failed.error_type == "template_error" and "roles must alternate" in failed.error_message


def test_too_long_is_an_error_or_keeps_the_head(tokenizer):
    long_text = " ".join([TEXT] * 40)
    limit = 120
    error = _builder(tokenizer, limit=limit).build(_row(long_text))
    assert error.error_type == "prompt_too_long" and error.num_prompt_tokens > limit
    builder = _builder(tokenizer, limit=limit, on_too_long="truncate", prompt_template="Summarize:\n{text}\nEnd.")
    prompt = builder.build(_row(long_text))
    assert prompt.error_type is None and limit - 8 <= len(prompt.token_ids) <= limit
    decoded = tokenizer.decode(prompt.token_ids)
    assert decoded.startswith("<|im_start|>user\nSummarize:\nAssert statements are")
    assert decoded.endswith("\nEnd.<|im_end|>\n<|im_start|>assistant\n")  # the frame survives the cut
    assert prompt.error_message.startswith("truncated from ")
    # When the frame alone is over the limit, truncating the text cannot help.
    tiny_limit = _builder(tokenizer, limit=5, on_too_long="truncate").build(_row(long_text))
    assert tiny_limit.error_type == "prompt_too_long"


def test_messages_truncate_the_last_message(tokenizer):
    messages = [{"role": "user", "content": "Summarize."}, {"role": "user", "content": " ".join([TEXT] * 40)}]
    prompt = _builder(tokenizer, limit=100, on_too_long="truncate").build(_row(messages))
    decoded = tokenizer.decode(prompt.token_ids)
    assert len(prompt.token_ids) <= 100 and decoded.startswith("<|im_start|>user\nSummarize.<|im_end|>")


def test_template_must_name_columns():
    with pytest.raises(ConfigError, match="placeholders must name a column"):
        JobConfig(prompt_template="{} {text}")
