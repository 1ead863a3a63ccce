"""A job's tokenizer identity (the manifest pins it): the canonical hash of the definition, computed once per
distinct definition in a process, and never stale after the tokenizer changes."""

from __future__ import annotations

import copy
import hashlib
import json

from batchllm.connectors.jobs.identity import tokenizer_identity


def _canonical_sha256(tokenizer) -> str:
    """The hash as manifests written before the cache recorded it: parsed, runtime keys dropped, sorted keys."""
    definition = json.loads(tokenizer.backend_tokenizer.to_str())
    for key in ("truncation", "padding"):
        definition.pop(key, None)
    return hashlib.sha256(json.dumps(definition, sort_keys=True).encode()).hexdigest()


def test_the_identity_is_the_canonical_hash_and_follows_changes(llm):
    tokenizer = copy.deepcopy(llm.tokenizer)  # changed below; the engine's stays as it is
    first = tokenizer_identity(tokenizer)
    assert first == tokenizer_identity(tokenizer)
    assert first["sha256"] == _canonical_sha256(tokenizer)
    template = tokenizer.chat_template
    assert first["chat_template_sha256"] == hashlib.sha256(json.dumps(template).encode()).hexdigest()

    tokenizer.backend_tokenizer.enable_truncation(max_length=64)  # a runtime setting: the same identity
    assert tokenizer_identity(tokenizer) == first
    tokenizer.add_tokens(["<a-token-no-vocabulary-has>"])
    changed = tokenizer_identity(tokenizer)
    assert changed["sha256"] == _canonical_sha256(tokenizer) != first["sha256"]
