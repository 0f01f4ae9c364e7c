"""Row formats: what a shard's rows are and what a run writes for them.

Parquet shards in (reader.py) and result and metrics files out (writer.py); OpenAI batch files
(openai_files.py, openai_requests.py, tool_calls.py); prompts (prompts.py), row checks (rows.py)
and logprob columns (logprobs.py); and the ShardFormat each run picks by data.format
(shard_format.py), which names the files its attempts commit.
"""
