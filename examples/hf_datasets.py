"""Generate over a Hugging Face `datasets.Dataset` with chat messages, keeping the dataset's own order.

    python examples/hf_datasets.py                 # the default model, 64 tokens per reply
    python examples/hf_datasets.py --max-tokens 16 --rows 2
"""

import argparse

import datasets

import batchllm

SYSTEM = "You are a concise assistant. Answer in one sentence."
PROMPTS = ["Name a primary color.", "What is the boiling point of water at sea level?",
           "Suggest a name for a pet turtle.", "What is the opposite of 'ancient'?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=len(PROMPTS))
    args = parser.parse_args()

    dataset = datasets.Dataset.from_dict({
        "id": list(range(len(PROMPTS))),
        "messages": [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}] for p in PROMPTS],
    })
    # Any select / shuffle / filter before generate is honoured: outputs line up with the rows you see.
    dataset = dataset.shuffle(seed=0).select(range(min(args.rows, len(PROMPTS))))
    answered = batchllm.generate(dataset, messages_column="messages", max_tokens=args.max_tokens, temperature=0)

    print(answered)
    for row in answered:
        print(f"{row['id']}: {row['messages'][-1]['content']} -> {row['generated_text'].strip()!r}")


if __name__ == "__main__":
    main()
