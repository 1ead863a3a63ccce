"""Synthetic data: n varied question/answer pairs per topic, written to Parquet.

    python examples/synthetic_data.py qa.parquet                    # 3 questions for each of 5 topics
    python examples/synthetic_data.py qa.parquet --topics 2 --per-topic 2 --max-tokens 16

Two passes over one DataFrame: questions are sampled (temperature 0.9, n per topic, seeded, so a rerun
gives the same data), then each question is answered greedily.
"""

import argparse

import pandas as pd

import batchllm

TOPICS = ["photosynthesis", "the Roman empire", "prime numbers", "ocean tides", "machine learning"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--topics", type=int, default=len(TOPICS))
    parser.add_argument("--per-topic", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    topics = pd.DataFrame({"topic": TOPICS[: args.topics]})
    # n samples per row come back as list columns; seeded sampling makes them reproducible.
    questions = topics.pipe(batchllm.generate, prompt_template="Ask one short quiz question about {topic}.",
                            chat=True, n=args.per_topic, temperature=0.9, seed=args.seed,
                            max_tokens=args.max_tokens, output_column="question")
    pairs = (questions[["topic", "question"]].explode("question", ignore_index=True)
             .assign(question=lambda df: df.question.str.strip()))
    pairs = pairs[pairs.question.str.len() > 0]
    qa = pairs.pipe(batchllm.generate, prompt_column="question", chat=True, temperature=0,
                    max_tokens=args.max_tokens, output_column="answer")

    qa = qa[["topic", "question", "answer", "answer_finish_reason", "answer_error"]]
    qa.to_parquet(args.output, index=False)
    print(qa.to_string(max_colwidth=60))
    print(f"\n{len(qa)} question/answer pairs written to {args.output}")


if __name__ == "__main__":
    main()
