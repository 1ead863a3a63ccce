"""The `batchllm` command: `run` (jobs over tables and OpenAI batch files) and `serve`; main.py parses and
dispatches, engine_flags.py maps flags to `LLM` arguments, types.py checks flag values, models.py the repeatable
`--model NAME=PATH`, resume.py a job resumed by its flags."""
