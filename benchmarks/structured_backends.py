"""Grammar engines for structured outputs on the host CPU: llguidance (batchllm's) against xgrammar.

    python benchmarks/structured_backends.py [--rows 200] [--steps 64] [--repeats 2] [--out FILE.md] [--tokenizer DIR]

With the default model's tokenizer (SmolLM2, 49,152 tokens) and the 10 JSON schemas of
tests/unit/test_grammar.py, both engines set to the same JSON layout (one line, `", "` and `": "`, extra
properties allowed: llguidance's default, xgrammar's `strict_mode=False`):

- compile: each schema once, cold (xgrammar: a fresh compiler per schema, so no cache helps), and the first
  bitmask after it: llguidance builds its lexer lazily, xgrammar precomputes token masks while compiling;
- matcher: creating a matcher from the compiled grammar (llguidance: batchllm's `new_matcher`, a copy of a
  template matcher; also a fresh `LLMatcher`, as engines that keep only the grammar text do);
- fill: `--rows` matchers filled in one batched call per step (llguidance: batchllm's `fill_bitmasks`, over
  `LLExecutor`; xgrammar: `BatchGrammarMatcher.batch_fill_next_token_bitmask`), every row then accepting the
  next token of a valid random path (one `accept_token` per row, timed apart). The paths are drawn once with
  llguidance and replayed on both, after checking that xgrammar accepts each of them whole; a row whose path
  ends takes a new matcher and path of its schema, so every row is live at every step. Rows start at
  different offsets of their paths. Scenarios: one schema for all rows, and the 10 schemas spread over rows.
  Each engine runs with its default thread count and with 2 threads; `--repeats` runs, engines interleaved,
  best mean kept (the host is shared).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch  # (xgrammar's bitmask is a torch tensor)
import xgrammar as xgr
from llguidance import LLExecutor, LLMatcher
from transformers import AutoTokenizer

from batchllm.engine.structured import llguidance_backend as grammar_module
from batchllm.engine.structured.llguidance_backend import GrammarCompiler, fill_bitmasks
from batchllm.model.default_model import default_model_path
from batchllm.structured_outputs import StructuredOutputsParams


def _test_suite_schemas() -> dict[str, dict]:
    """The schemas of tests/unit/test_grammar.py, loaded from its file: the repo root stays off sys.path, where its
    kernels/ folder would shadow HF's `kernels` package (transformers imports it)."""
    path = Path(__file__).resolve().parents[1] / "tests" / "unit" / "test_grammar.py"
    spec = importlib.util.spec_from_file_location("grammar_test_suite", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module.SCHEMAS


SCHEMAS = _test_suite_schemas()

EOS = 2  # SmolLM2-Instruct's <|im_end|>


def now() -> float:
    return time.perf_counter()


def allowed_ids(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def random_path(compiler: GrammarCompiler, params, closers, quoted, rng, budget=48, cap=600) -> list[int]:
    """A complete random output (ending in EOS): random allowed tokens, past `budget` steering to the end."""
    matcher = compiler.new_matcher(params)
    row = np.zeros(compiler.bitmask_width, dtype=np.int32)
    tokens: list[int] = []
    while len(tokens) < cap:
        matcher.fill_bitmask(row)
        allowed = allowed_ids(row)
        others = allowed[allowed != EOS]
        if matcher.can_finish and (len(tokens) >= budget or not others.size):
            return tokens + [EOS]
        pool = others
        if len(tokens) >= budget:
            closing, quoting = np.intersect1d(others, closers), np.intersect1d(others, quoted)
            pool = quoting if quoting.size and rng.random() < 0.5 else closing if closing.size else others
        tokens.append(int(rng.choice(pool)))
        assert matcher.accept_token(tokens[-1])
    raise RuntimeError("a random path did not end")


class Llg:
    name = "llguidance"

    def __init__(self, compiler: GrammarCompiler, threads: int | None):
        self.compiler, self.threads = compiler, threads
        self.executor = LLExecutor(threads) if threads else LLExecutor()

    def new(self, params):
        return self.compiler.new_matcher(params)

    def bitmask(self, rows):
        return np.zeros((rows, self.compiler.bitmask_width), dtype=np.int32)

    def fill(self, matchers, out):
        grammar_module._executor = self.executor
        fill_bitmasks(matchers, out)

    @staticmethod
    def row(out, i):
        return out[i]


class Xgr:
    name = "xgrammar"

    def __init__(self, compiled: dict, threads: int | None):
        self.compiled, self.threads = compiled, threads
        self.batch = xgr.BatchGrammarMatcher(threads if threads else "auto")

    def new(self, params):
        return xgr.GrammarMatcher(self.compiled[params.key])

    def bitmask(self, rows):
        return xgr.allocate_token_bitmask(rows, 49152)

    def fill(self, matchers, out):
        self.batch.batch_fill_next_token_bitmask(matchers, out)

    @staticmethod
    def row(out, i):
        return out[i].numpy()


def run_fill(engine, row_params, paths, steps, check=True) -> dict:
    """Steps of batched fill + per-row accept along the given paths; times in seconds per step."""
    rows = len(row_params)
    matchers, cursors = [], []
    for i, params in enumerate(row_params):
        pool = paths[params.key]
        path_index = i % len(pool)
        offset = (i * 13) % (len(pool[path_index]) - 1)
        matcher = engine.new(params)
        for token in pool[path_index][:offset]:
            assert matcher.accept_token(token)
        matchers.append(matcher)
        cursors.append([path_index, offset])
    out = engine.bitmask(rows)
    fill_times, accept_times, renewals = [], [], 0
    for _ in range(steps):
        start = now()
        engine.fill(matchers, out)
        fill_times.append(now() - start)
        next_tokens = [paths[p.key][c[0]][c[1]] for p, c in zip(row_params, cursors)]
        if check:
            for i, token in enumerate(next_tokens):
                word = int(engine.row(out, i)[token // 32])
                assert (word >> (token % 32)) & 1, (engine.name, i, token)
        start = now()
        for matcher, token in zip(matchers, next_tokens):
            if not matcher.accept_token(token):
                raise AssertionError(f"{engine.name} rejected a path token")
        accept_times.append(now() - start)
        for i, (params, cursor) in enumerate(zip(row_params, cursors)):
            cursor[1] += 1
            pool = paths[params.key]
            if cursor[1] == len(pool[cursor[0]]):  # the output ended: a new request of that schema
                cursor[0], cursor[1] = (cursor[0] + 1) % len(pool), 0
                matchers[i] = engine.new(params)
                renewals += 1
    return {"fill_mean": statistics.mean(fill_times), "fill_median": statistics.median(fill_times),
            "accept_mean": statistics.mean(accept_times), "renewals": renewals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--paths", type=int, default=8, help="random paths per schema")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer directory (default: the default model's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_model_path())
    vocab = len(tokenizer)
    versions = {n: importlib.metadata.version(n) for n in ("llguidance", "xgrammar", "torch", "transformers")}
    print(f"cpus {os.cpu_count()}  load {os.getloadavg()}  versions {versions}")

    start = now()
    llg_compiler = GrammarCompiler(tokenizer, vocab, [EOS])
    llg_setup = now() - start
    start = now()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[EOS])
    xgr_setup = now() - start
    print(f"tokenizer setup: llguidance {llg_setup * 1e3:.0f} ms, xgrammar {xgr_setup * 1e3:.0f} ms")

    params = {name: StructuredOutputsParams(json=schema) for name, schema in SCHEMAS.items()}
    compile_rows, xgr_compiled = [], {}
    for name, p in params.items():
        start = now()
        llg_compiler.compile(p)
        llg_compile = now() - start
        row = np.zeros(llg_compiler.bitmask_width, dtype=np.int32)
        start = now()
        llg_compiler.new_matcher(p).fill_bitmask(row)
        llg_first = now() - start
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # default max_threads=8
        start = now()
        xgr_compiled[p.key] = compiler.compile_json_schema(p.spec, any_whitespace=False, separators=(", ", ": "),
                                                           strict_mode=False)
        xgr_compile = now() - start
        mask = xgr.allocate_token_bitmask(1, vocab)
        start = now()
        xgr.GrammarMatcher(xgr_compiled[p.key]).fill_next_token_bitmask(mask)
        xgr_first = now() - start
        compile_rows.append((name, llg_compile, llg_first, xgr_compile, xgr_first))
        print(f"compile {name:15s} llguidance {llg_compile * 1e3:7.2f} ms + first mask {llg_first * 1e3:6.2f} ms"
              f" | xgrammar {xgr_compile * 1e3:8.1f} ms + first mask {xgr_first * 1e3:6.2f} ms")

    n = 200
    creation = {"llguidance new_matcher (copy)": [], "llguidance LLMatcher(grammar)": [], "xgrammar GrammarMatcher": []}
    for p in params.values():
        compiled = llg_compiler.compile(p)
        start = now()
        for _ in range(n):
            llg_compiler.new_matcher(p)
        creation["llguidance new_matcher (copy)"].append((now() - start) / n)
        start = now()
        for _ in range(n):
            LLMatcher(llg_compiler._ll_tokenizer, compiled.grammar, log_level=0)
        creation["llguidance LLMatcher(grammar)"].append((now() - start) / n)
        start = now()
        for _ in range(n):
            xgr.GrammarMatcher(xgr_compiled[p.key])
        creation["xgrammar GrammarMatcher"].append((now() - start) / n)
    for what, times in creation.items():
        print(f"matcher creation {what}: {statistics.mean(times) * 1e6:.1f} us (mean over schemas)")

    pieces = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    closers = np.array([i for i, s in enumerate(pieces) if s and set(s) <= set('"]}')])
    quoted = np.array([i for i in closers if '"' in pieces[i]])
    rng = np.random.default_rng(0)
    paths, dropped = {}, 0
    for p in params.values():
        pool = []
        for _ in range(args.paths):
            path = random_path(llg_compiler, p, closers, quoted, rng)
            matcher = xgr.GrammarMatcher(xgr_compiled[p.key])
            if all(matcher.accept_token(t) for t in path) and matcher.is_terminated():
                pool.append(path)
            else:
                dropped += 1
        assert pool, f"xgrammar accepts no path of {p.key}"
        paths[p.key] = pool
    lengths = [len(path) for pool in paths.values() for path in pool]
    print(f"paths: {len(lengths)} kept, {dropped} xgrammar rejected; {statistics.mean(lengths):.0f} tokens mean")

    scenarios = {"1 schema": [params["nested_object"]] * args.rows,
                 "10 schemas": [list(params.values())[i % len(params)] for i in range(args.rows)]}
    engines = [Llg(llg_compiler, None), Llg(llg_compiler, 2), Xgr(xgr_compiled, None), Xgr(xgr_compiled, 2)]
    for engine in engines:  # warm both: first steps along the paths build lazy state once
        run_fill(engine, scenarios["10 schemas"], paths, 8)
    fill_rows = []
    for scenario, row_params in scenarios.items():
        best = {}
        for _ in range(args.repeats):
            for engine in engines:
                result = run_fill(engine, row_params, paths, args.steps)
                label = (engine.name, engine.threads or "default")
                if label not in best or result["fill_mean"] < best[label]["fill_mean"]:
                    best[label] = result
        for (name, threads), r in best.items():
            fill_rows.append((scenario, name, threads, r))
            print(f"fill {scenario:10s} {name:10s} threads {threads!s:7s}: {r['fill_mean'] * 1e6:8.0f} us/step "
                  f"(median {r['fill_median'] * 1e6:.0f}), {r['fill_mean'] / args.rows * 1e6:6.1f} us/row; "
                  f"accept {r['accept_mean'] * 1e6:6.0f} us/step; {r['renewals']} outputs ended")
    if args.out:
        args.out.write_text(report(args, versions, llg_setup, xgr_setup, compile_rows, creation, fill_rows,
                                   len(lengths), dropped, statistics.mean(lengths)))
        print(f"wrote {args.out}")


def report(args, versions, llg_setup, xgr_setup, compile_rows, creation, fill_rows, kept, dropped, mean_len) -> str:
    lines = [
        "# Structured outputs: llguidance vs xgrammar on the host CPU",
        "",
        f"`python benchmarks/structured_backends.py --rows {args.rows} --steps {args.steps} "
        f"--repeats {args.repeats}`. Machine: {os.cpu_count()} cores of a shared CPU (other jobs running: "
        f"load average {os.getloadavg()[0]:.1f} at the end), no GPU. "
        + ", ".join(f"{k} {v}" for k, v in versions.items()) + ". Tokenizer: SmolLM2-135M-Instruct (49,152).",
        "",
        f"Tokenizer setup, once per engine: llguidance {llg_setup * 1e3:.0f} ms, xgrammar {xgr_setup * 1e3:.0f} ms.",
        "",
        "Compile, cold, per schema (ms); first mask = the first bitmask of a new matcher after it:",
        "",
        "| schema | llguidance compile | + first mask | xgrammar compile | + first mask |",
        "|---|---|---|---|---|",
    ]
    for name, lc, lf, xc, xf in compile_rows:
        lines.append(f"| {name} | {lc * 1e3:.2f} | {lf * 1e3:.2f} | {xc * 1e3:.1f} | {xf * 1e3:.2f} |")
    means = [statistics.mean(r[i] for r in compile_rows) * 1e3 for i in range(1, 5)]
    lines.append(f"| **mean** | **{means[0]:.2f}** | {means[1]:.2f} | **{means[2]:.1f}** | {means[3]:.2f} |")
    lines += ["", "Matcher creation (µs, mean over the 10 schemas):", "", "| matcher | µs |", "|---|---|"]
    lines += [f"| {what} | {statistics.mean(t) * 1e6:.1f} |" for what, t in creation.items()]
    lines += ["", f"Bitmask fill, {args.rows} rows, one batched call per step, {args.steps} steps along random valid "
              f"paths ({kept} paths, {mean_len:.0f} tokens mean, {dropped} rejected by xgrammar); accept = "
              f"{args.rows} single `accept_token` calls:", "",
              "| rows' schemas | engine | threads | fill µs/step | median | fill µs/row | accept µs/step |",
              "|---|---|---|---|---|---|---|"]
    for scenario, name, threads, r in fill_rows:
        lines.append(f"| {scenario} | {name} | {threads} | {r['fill_mean'] * 1e6:.0f} | {r['fill_median'] * 1e6:.0f}"
                     f" | {r['fill_mean'] / args.rows * 1e6:.1f} | {r['accept_mean'] * 1e6:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
