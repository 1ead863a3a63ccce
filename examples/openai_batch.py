"""Answer an OpenAI Batch API request file locally: requests JSONL in, OpenAI batch output JSONL out.

    python examples/openai_batch.py /tmp/batchllm-batch            # writes requests.jsonl and results.jsonl there
    python examples/openai_batch.py /tmp/batchllm-batch --max-tokens 8

The same from the command line: `batchllm run requests.jsonl results.jsonl`.
"""

import argparse
import json
from pathlib import Path

import batchllm


def requests(max_tokens: int) -> list[str]:
    chat = [("capital", "What is the capital of Japan?"), ("haiku", "Write a haiku about autumn.")]
    lines = [json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}],
                                  "max_tokens": max_tokens, "temperature": 0}}) for cid, text in chat]
    lines.append(json.dumps({"custom_id": "completion", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0.7,
                                      "seed": 1}}))
    lines.append('{"custom_id": "broken", "method": "POST", "url": ')  # a malformed line: answered with an error
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    request_file, result_file = args.workdir / "requests.jsonl", args.workdir / "results.jsonl"
    if not request_file.exists():
        request_file.write_text("\n".join(requests(args.max_tokens)) + "\n")
    batchllm.run_job(request_file, result_file, use_tqdm=False)

    for line in result_file.read_text().splitlines():
        result = json.loads(line)
        if result["error"] is not None:
            print(f"{result['custom_id']}: error: {result['error']['message']}")
            continue
        choice = result["response"]["body"]["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        print(f"{result['custom_id']}: {text.strip()!r} ({choice['finish_reason']})")


if __name__ == "__main__":
    main()
