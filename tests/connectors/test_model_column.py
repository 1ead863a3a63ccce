"""`batchllm run --model NAME=PATH` (repeatable) with `--model-column`: each row runs on the model it names. The models
are the default one under two names ("a", "b") and a tiny random-weight Llama written by transformers ("tiny", with
the default model's tokenizer), so the two answer differently; every answer is compared with that model's own
`LLM.generate` on the prompt, run alone. Unknown and null names fail their rows only; an interrupted job resumes to
every row exactly once; a resume under another model map is refused; an OpenAI batch file routes by `model`."""

from __future__ import annotations

import json
import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchllm
from batchllm import LLM
from batchllm.connectors.jobs import model_router
from batchllm.connectors.jobs.job import JobInterrupted
from batchllm.connectors.jobs.manifest import ManifestMismatch
from batchllm.entrypoints.cli.main import _parser, main
from batchllm.model.default_model import default_model_path
from tests.connectors.helpers import GREEDY, reference_texts
from tests.connectors.jobs import SUBJECTS, read_shards

ENGINE = {"device": "cpu", "num_kv_blocks": 64}
# Interleaved, with a null and an unknown name: the job must switch engines and keep going.
WHICH = ["a", "tiny", "b", "tiny", None, "nope", "a", "tiny", "b"]
JOB = {"prompt_column": "q", "model_column": "which", "rows_per_shard": 3, "max_in_flight": 2, "use_tqdm": False,
       **GREEDY}


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LLM(tiny_dir, **ENGINE)


def _prompt(i: int) -> str:
    return f"Row {i}: a sentence about {SUBJECTS[i % 10]}:"


@pytest.fixture(scope="module")
def references(llm, tiny):
    """Each model's greedy text for every row's prompt, each model run alone."""
    prompts = [_prompt(i) for i in range(len(WHICH))]
    texts = {"tiny": reference_texts(tiny, prompts)}
    texts["a"] = texts["b"] = reference_texts(llm, prompts)
    assert all(x != y for x, y in zip(texts["a"], texts["tiny"])), "the two models must answer differently"
    return texts


def _input(directory, which=WHICH, column="which"):
    directory.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(which))), "q": [_prompt(i) for i in range(len(which))], column: which})
    pq.write_table(table, directory / "in.parquet")
    return table


def _check(output, table, references, column="which"):
    """Every row exactly once, with its own model's text and name (None where it names no model)."""
    shards = read_shards(output).sort_by("id")
    assert shards.column("id").to_pylist() == table.column("id").to_pylist()
    names = [n if n in ("a", "b", "tiny") else None for n in table.column(column).to_pylist()]
    assert shards.column("generated_text").to_pylist() == [None if n is None else references[n][i]
                                                           for i, n in enumerate(names)]
    if column != "model":
        assert shards.column("model").to_pylist() == names
    return shards


def test_each_row_runs_on_the_model_it_names_and_a_sigint_resumes_every_row_once(llm, tiny, references, tmp_path,
                                                                                  monkeypatch):
    table = _input(tmp_path / "in")
    steps, real_step = [], tiny.engine.step

    def step():
        steps.append(1)
        if len(steps) == 3:
            signal.raise_signal(signal.SIGINT)  # its handler has run when this returns
        return real_step()

    monkeypatch.setattr(tiny.engine, "step", step)
    models = {"a": llm, "b": llm, "tiny": tiny}
    with pytest.raises(JobInterrupted) as interrupted:
        batchllm.run_job(tmp_path / "in", tmp_path / "out", models=models, **JOB)
    done = interrupted.value.result.written_rows
    assert 0 < done < len(WHICH) and not tiny.engine.has_unfinished()

    result = batchllm.run_job(tmp_path / "in", tmp_path / "out", models=models, **JOB)
    assert (result.resumed_rows, result.written_rows) == (done, len(WHICH) - done)
    shards = _check(tmp_path / "out", table, references)
    assert shards.column_names[:4] == ["id", "q", "which", "model"]  # the input's columns, then the model's
    errors = shards.column("error").to_pylist()
    assert errors[4] == "model column 'which' is null; the models are a, b, tiny"
    assert errors[5] == "model column 'which' names 'nope', which is not one of the job's models; the models are a, " \
                        "b, tiny"
    assert [e for i, e in enumerate(errors) if i not in (4, 5)] == [None] * 7


def test_a_model_column_called_model_is_the_output_one_and_another_model_map_is_refused(llm, tiny, references,
                                                                                         tmp_path):
    table = _input(tmp_path / "in", ["tiny", "a", "x"], column="model")
    job = {**JOB, "model_column": "model"}
    batchllm.run_job(tmp_path / "in", tmp_path / "out", models={"a": llm, "tiny": tiny}, **job)
    shards = _check(tmp_path / "out", table, references, column="model")
    assert shards.column_names[:4] == ["id", "q", "model", "generated_text"]
    assert shards.column("model").to_pylist() == ["tiny", "a", "x"]  # the input's, unchanged

    with pytest.raises(ManifestMismatch, match=r"models\.c"):  # a name more
        batchllm.run_job(tmp_path / "in", tmp_path / "out", models={"a": llm, "tiny": tiny, "c": llm}, **job)
    with pytest.raises(ManifestMismatch, match=r"models\.a\.model"):  # names swapped
        batchllm.run_job(tmp_path / "in", tmp_path / "out", models={"a": tiny, "tiny": llm}, **job)


def test_the_command_builds_an_engine_per_directory_and_refuses_another_model_map(tiny_dir, references, tmp_path,
                                                                                  capsys, monkeypatch):
    table = _input(tmp_path / "in", WHICH[:4])
    built = []

    class Counted(LLM):
        def __init__(self, model, **kwargs):
            built.append(model)
            super().__init__(model, **kwargs)

    monkeypatch.setattr(model_router, "LLM", Counted)
    run = ["run", str(tmp_path / "in"), str(tmp_path / "out"), "--prompt-column", "q", "--model-column", "which",
           "--max-tokens", str(GREEDY["max_tokens"]), "--rows-per-shard", "3", "--no-progress", "--device", "cpu",
           "--num-kv-blocks", "64"]
    default = str(default_model_path())
    assert main([*run, "--model", f"a={default}", "--model", f"b={default}", "--model", f"tiny={tiny_dir}"]) == 0
    assert built == [default, str(tiny_dir)]  # a and b share one engine
    _check(tmp_path / "out", table, references)

    capsys.readouterr()
    assert main([*run, "--model", f"a={tiny_dir}", "--model", f"b={tiny_dir}", "--model", f"tiny={tiny_dir}"]) == 2
    err = capsys.readouterr().err
    assert "the output was started by a different job" in err
    assert "  --model (models.a.model.name): was" in err and "  --model (models.b.model.name): was" in err


def test_a_batch_file_routes_each_request_by_its_model(llm, tiny, references, tmp_path):
    models = ["a", "tiny", None, "nope", "tiny"]
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": _prompt(i), **({"model": model} if model else {})}})
             for i, model in enumerate(models)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    batchllm.run_job(tmp_path / "in.jsonl", tmp_path / "out.jsonl", models={"a": llm, "tiny": tiny},
                     rows_per_shard=2, max_in_flight=2, use_tqdm=False, **GREEDY)
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(a["custom_id"] for a in answers) == [f"r{i}" for i in range(len(models))]
    for answer in answers:
        i = int(answer["custom_id"][1:])
        if models[i] == "nope":
            assert answer["response"] is None
            assert answer["error"]["message"] == f"line {i + 1}: body.model 'nope' is not one of the models of this " \
                                                 f"job: a, tiny"
            continue
        model = models[i] or "a"  # no model: the first, as the server does
        body = answer["response"]["body"]
        assert (body["model"], body["choices"][0]["text"]) == (model, references[model][i])


@pytest.mark.parametrize("flags, message", [
    (["--model", "a=x", "--model", "b=y"], "several --model need --model-column NAME, the column naming each row's "
                                           "model (one of a, b)"),
    (["--model-column", "which"], "--model-column needs the models it names: --model NAME=PATH (repeatable)"),
    (["--model", "a=x", "--model-column", "nope"], "unknown column 'nope' (--model-column)"),
    (["--model", "/m/x", "--model", "/n/x", "--model-column", "which"], "--model names two models 'x'"),
    (["--model", "a=x", "--model", "b=y", "--model-column", "which", "--lora", "l=z", "--lora-column", "which"],
     "--lora applies to a job of one --model"),
    (["--model", "a=x", "--model", "b=y", "--model-column", "which", "--data-parallel", "2"],
     "--data-parallel 2 with --model (several models) is not supported"),
    (["--model", "a=x", "--model", "b=y", "--model-column", "which", "--task", "embed"],
     "--task 'embed' is not supported with it"),
    (["--model", "a=x", "--model", "b=y", "--model-column", "which", "--dry-run"],
     "--dry-run plans the rows of one model: give one --model"),
])
def test_usage_errors_are_one_line_before_any_engine(tmp_path, capsys, monkeypatch, flags, message):
    class NoEngine(LLM):
        def __init__(self, *args, **kwargs):
            pytest.fail("an engine was built")

    monkeypatch.setattr(model_router, "LLM", NoEngine)
    _input(tmp_path / "in")
    assert main(["run", str(tmp_path / "in"), str(tmp_path / "out"), "--prompt-column", "q", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchllm: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_batch_file_takes_no_model_column(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text(json.dumps({"custom_id": "r", "method": "POST", "url": "/v1/completions",
                                                   "body": {"prompt": "hi"}}) + "\n")
    assert main(["run", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--model", "a=x",
                 "--model-column", "which"]) == 2
    assert "--model-column does not apply to an OpenAI batch file" in capsys.readouterr().err


def test_run_and_serve_read_model_flags_alike():
    for value, parsed in (("a=/m/x", ("a", "/m/x")), ("/m/x", (None, "/m/x")), ("/m/a=b", (None, "/m/a=b"))):
        run = _parser().parse_args(["run", "in", "out", "--model", value]).model
        serve = _parser().parse_args(["serve", "--model", value]).model
        assert run == serve == [parsed]


def test_engines_on_one_gpu_split_its_memory_evenly(monkeypatch):
    """Each engine's profiling counts the engines built before it in the process: shares are cumulative."""
    built = []

    class Recorded(LLM):
        def __init__(self, model, **kwargs):
            built.append((model, kwargs))

    monkeypatch.setattr(model_router, "LLM", Recorded)
    with model_router.model_engines({"a": "/m/x", "b": "/m/x", "c": "/m/y", "d": "/m/z"},
                                    {"gpu_memory_utilization": 0.6, "max_num_seqs": 8}) as engines:
        assert engines["a"] is engines["b"] and len({id(e) for e in engines.values()}) == 3
    assert [(model, kwargs["gpu_memory_utilization"]) for model, kwargs in built] == [
        ("/m/x", pytest.approx(0.2)), ("/m/y", pytest.approx(0.4)), ("/m/z", pytest.approx(0.6))]
    assert all(kwargs["max_num_seqs"] == 8 for _, kwargs in built)
    built.clear()
    with model_router.model_engines({"a": "/m/x", "c": "/m/y"}, {"device": "cpu"}):
        assert built == [("/m/x", {"device": "cpu"}), ("/m/y", {"device": "cpu"})]  # no GPU memory to share
