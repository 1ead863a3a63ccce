"""Answer a column of questions in a pandas DataFrame with `df.pipe(batchllm.generate, ...)`.

    python examples/pandas_pipe.py                 # the default model, 64 tokens per answer
    python examples/pandas_pipe.py --max-tokens 16 --rows 3
"""

import argparse

import pandas as pd

import batchllm

QUESTIONS = {
    "q-geo": "What is the capital of Italy?",
    "q-math": "What is 12 times 12?",
    "q-bio": "Why do plants need sunlight?",
    "q-code": "What does the Python function len() return?",
    "q-bad": None,  # a missing prompt: this row gets an error, the others are answered
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=len(QUESTIONS))
    args = parser.parse_args()

    df = pd.DataFrame({"question": list(QUESTIONS.values())}, index=pd.Index(list(QUESTIONS), name="id"))
    df = df.head(args.rows)
    # chat=True sends each question as a user message through the model's chat template.
    answers = df.pipe(batchllm.generate, prompt_column="question", chat=True, max_tokens=args.max_tokens,
                      temperature=0)

    for qid, row in answers.iterrows():  # the index and the row order are the input's
        outcome = f"error: {row.error}" if pd.notna(row.error) else row.generated_text.strip()
        print(f"[{qid}] {row.question}\n    -> {outcome}  ({row.completion_tokens} tokens, {row.finish_reason})")


if __name__ == "__main__":
    main()
