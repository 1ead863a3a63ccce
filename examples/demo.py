"""Run the default model (SmolLM2-135M-Instruct) on a few chat prompts and print the answers.

    python examples/demo.py        # or: make demo
"""

import time

from batchllm import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into Spanish and German.",
    "Give me a Python one-liner that reverses a string.",
]


def main() -> None:
    start = time.perf_counter()
    llm = LLM()
    loaded = time.perf_counter()
    conversations = [[{"role": "user", "content": question}] for question in QUESTIONS]
    outputs = llm.chat(conversations, SamplingParams(max_tokens=64, temperature=0))
    done = time.perf_counter()

    for question, output in zip(QUESTIONS, outputs):
        print(f"\n>>> {question}\n{output.outputs[0].text.strip()}")

    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    seconds = done - loaded
    print(f"\nloaded in {loaded - start:.1f} s; generated {output_tokens} tokens for {len(outputs)} prompts "
          f"({prompt_tokens} prompt tokens) in {seconds:.1f} s: {output_tokens / seconds:.1f} output tok/s")
    print(f"engine stats: {llm.stats}")


if __name__ == "__main__":
    main()
