"""A refused resume on the command line: what changed since the job started, named by flag (`--temperature`), not
by the manifest's keys (`options.sampling_params.temperature`)."""

from __future__ import annotations

import re

from batchllm.connectors.jobs.manifest import ManifestMismatch, mismatch_message

# Fingerprint parts that are files, not options: named by what the user passed, with the detail that changed.
_FILES = {"input": "INPUT", "model": "--model", "tokenizer": "--model", "adapters": "--lora", "models": "--model",
          "default_model": "--model"}
# Keys that hold options rather than being one: `options.sampling_params.top_p` is --top-p.
_GROUPS = ("options", "defaults", "sampling_params", "prompt", "pooling", "quantization")
# Options whose flag is not their name.
_FLAGS = {"structured_outputs": "--json-schema / --regex / --choice", "loras": "--lora", "classify": "--task"}
# Whole groups that appear or go with a flag: sampling options exist only for --task generate.
_WHOLE = {"options.sampling_params": "--task", "quantization": "--quantization / --kv-cache-dtype"}


def changed_options_message(exc: ManifestMismatch, flags: dict[str, str]) -> str:
    """`exc`'s message with each difference under its flag (`flags`: flag by Python name)."""
    if not exc.differences or exc.manifest is None:
        return str(exc)
    return mismatch_message(exc.manifest, exc.differences, lambda key: _flag_of(key, flags))


def _flag_of(key: str, flags: dict[str, str]) -> str:
    if key in _WHOLE:
        return _WHOLE[key]
    parts = re.sub(r"\[\d+\]", "", key).split(".")
    if parts[0] in _FILES:
        return f"{_FILES[parts[0]]} ({key})"
    while len(parts) > 1 and parts[0] in _GROUPS:
        parts = parts[1:]
    name = parts[0]
    return _FLAGS.get(name) or flags.get(name) or key  # a Python-only option (no flag) keeps its key
