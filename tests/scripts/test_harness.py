"""kvzoo as an lm-evaluation-harness model (kvzoo/eval/harness.py) and its offline tasks (kvzoo/eval/tasks), on
the embedded SmolLM2: every request type against a direct computation, batched against unbatched, the harness
end to end with `limit` small, and the errors a user meets."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval", reason="scripts/install.sh installs lm_eval (the eval extra); CI runs these tests")
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from kvzoo.eval.harness import KvzooLM  # noqa: E402
from kvzoo.eval.perplexity import perplexity  # noqa: E402
from kvzoo.eval.tasks import task_dir  # noqa: E402
from kvzoo.eval.tasks.data import gsm8k, wikitext_articles  # noqa: E402
from tests.scripts.scripts_module import run_in_process  # noqa: E402

QUANTIZED = "kivi:bits=2,group_size=32,residual=32"       # contexts of 40+ tokens leave its windows quantized
PAIRS = [("The capital of France is", " Paris"), ("The capital of France is", " London"),
         ("Question: what is two plus two? Answer:", " four"), ("", "Hello world"),
         ("One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
          "seventeen eighteen nineteen twenty, and again: one two three four five six seven eight nine ten eleven "
          "twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen", " twenty twenty-one")]


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def loaded(default_model):
    return default_model


def lm(loaded, cache="fp16", **kw) -> KvzooLM:
    return KvzooLM(pretrained=loaded, cache=cache, **kw)


def test_loglikelihood_equals_a_direct_forward(loaded):
    """fp16: each continuation's log-probability and greediness from one forward over context + continuation."""
    model, tok = loaded
    harness = lm(loaded)
    got = harness.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(PAIRS, got):
        ctx, cont = harness._encode_pair(context, continuation)
        logits = model(torch.tensor([ctx + cont]))[0, len(ctx) - 1:-1].float()
        lp = F.log_softmax(logits, -1)[torch.arange(len(cont)), cont]
        assert logprob == pytest.approx(lp.sum().item(), abs=1e-4)
        assert greedy == bool((logits.argmax(-1) == torch.tensor(cont)).all())
    assert got[0][0] > got[1][0]                          # Paris over London


@pytest.mark.parametrize("cache", ["fp16", QUANTIZED, "innerq:sink=4,recent=32"])
def test_batched_equals_unbatched(loaded, cache):
    """Left-padded contexts and right-padded continuations side by side give each row what it gives alone."""
    alone = lm(loaded, cache, batch_size=1).loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    batched = lm(loaded, cache, batch_size=4).loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    for (a, ga), (b, gb) in zip(alone, batched):
        assert b == pytest.approx(a, abs=1e-3) and ga == gb


def test_a_quantized_cache_changes_the_scores_and_reports_its_bytes(loaded):
    fp16 = lm(loaded).loglikelihood(requests("loglikelihood", PAIRS[4:]), disable_tqdm=True)
    harness = lm(loaded, QUANTIZED)
    quantized = harness.loglikelihood(requests("loglikelihood", PAIRS[4:]), disable_tqdm=True)
    assert quantized[0][0] != pytest.approx(fp16[0][0], abs=1e-6)
    report = harness.kv_report["loglikelihood"]
    assert report.rows == 1 and 0 < report.nbytes and report.fp16_nbytes > 0


def test_cache_options_follow_the_spec_as_their_own_model_args(loaded):
    """`cache=innerq:bits=2,sink=4,recent=32` arrives from lm-eval split at its commas."""
    harness = KvzooLM.create_from_arg_string("cache=innerq:bits=2,sink=4,recent=32", {"pretrained": loaded})
    assert (harness.spec.name, harness.spec.options.bits, harness.spec.options.sink) == ("innerq", 2, 4)
    with pytest.raises(ValueError, match="unknown cache 'nope'; available caches: "):
        lm(loaded, "nope")
    with pytest.raises(ValueError, match="bogus"):
        lm(loaded, "kivi", bogus=1)
    with pytest.raises(ValueError, match="batch_size=auto is not supported"):
        lm(loaded, batch_size="auto")
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1, got 0"):
        lm(loaded, prefill_chunk=0)
    with pytest.raises(ValueError, match="max_length must be >= 2 .*got 1"):
        lm(loaded, max_length=1)


def test_chunked_prefill_scores_as_one_prefill(loaded):
    """prefill_chunk stores the contexts a few tokens at a time: fp16 scores do not change."""
    whole = lm(loaded, batch_size=2).loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    chunked = lm(loaded, batch_size=2, prefill_chunk=8).loglikelihood(requests("loglikelihood", PAIRS),
                                                                       disable_tqdm=True)
    for (a, ga), (b, gb) in zip(whole, chunked):
        assert b == pytest.approx(a, abs=1e-4) and ga == gb


@pytest.mark.parametrize("cache", ["fp16", QUANTIZED])
def test_rolling_loglikelihood_equals_perplexity_on_one_window(loaded, cache):
    """A text of L - 1 tokens after BOS is one rolling window: its log-likelihood through the harness (simulated
    mode, the BOS its exact prompt) is what scripts/perplexity.py scores on the window [BOS] + text with
    prompt=1 (perplexity's windows are disjoint and leave each window's first `prompt` tokens unscored; lm-eval's
    predict every token, a later window from the token before it: they agree window for window only so)."""
    model, tok = loaded
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
    ids = [tok.bos_id] + tok.encode(text, bos=False)
    harness = lm(loaded, cache, max_length=len(ids), prompt=1)
    total = harness.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]), disable_tqdm=True)[0]
    ppl = perplexity(model, ids, seq_len=len(ids), cache=cache, prompt=1, progress=False).perplexity
    assert -total / (len(ids) - 1) == pytest.approx(math.log(ppl), abs=1e-4)


@pytest.mark.parametrize("cache", [QUANTIZED, "innerq:bits=2,sink=0,recent=32"])
def test_rolling_prompt_is_read_exact_and_gives_the_statistics(loaded, cache):
    """prompt=P: a window's first P tokens are its exact prompt (InnerQ's key norm taken from them). The window's
    log-likelihood is then the exact one of its first P - 1 predictions plus what scripts/perplexity.py scores
    with prompt=P (the predictions after the prompt), and a longer prompt changes it."""
    model, tok = loaded
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
    ids = [tok.bos_id] + tok.encode(text, bos=False)
    P = 24
    rolling = requests("loglikelihood_rolling", [(text,)])
    total = lm(loaded, cache, max_length=len(ids), prompt=P).loglikelihood_rolling(rolling, disable_tqdm=True)[0]
    logits = model(torch.tensor([ids[:P]]))[0].float()
    exact = F.log_softmax(logits[:P - 1], -1)[torch.arange(P - 1), torch.tensor(ids[1:P])].sum().item()
    ppl = perplexity(model, ids, seq_len=len(ids), cache=cache, prompt=P, progress=False).perplexity
    assert total == pytest.approx(exact - (len(ids) - P) * math.log(ppl), abs=1e-3)
    longer = lm(loaded, cache, max_length=len(ids), prompt=2 * P).loglikelihood_rolling(rolling, disable_tqdm=True)[0]
    assert longer != pytest.approx(total, abs=1e-3)
    with pytest.raises(ValueError, match="prompt must be >= 1"):
        lm(loaded, cache, prompt=0)


def test_rolling_windows_cover_every_token(loaded):
    """fp16 over several windows of max_length: the sum over windows of each token's log-probability."""
    model, tok = loaded
    text = " ".join(f"line {i} of the text" for i in range(30))
    ids = tok.encode(text, bos=False)
    L = 48
    total = lm(loaded, max_length=L).loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]),
                                                            disable_tqdm=True)[0]
    want, inputs = 0.0, [tok.bos_id] + ids
    for a in range(0, len(ids), L):                     # window: predict ids[a:a+L] from the token before each
        start = max(0, a + min(L, len(ids) - a) - L)    # lm-eval's windows keep a full max_length of context
        window = inputs[start:a + min(L, len(ids) - a)]
        logits = model(torch.tensor([window]))[0].float()
        n = min(L, len(ids) - a)
        target = torch.tensor(ids[a:a + n])
        want += F.log_softmax(logits[-n:], -1)[torch.arange(n), target].sum().item()
    assert total == pytest.approx(want, abs=1e-3)


def test_generate_until_stops_and_batches(loaded):
    args = [("Q: What is the capital of France?\nA:", {"until": ["\n"], "max_gen_toks": 24}),
            ("Q: What is the capital of Italy?\nA:", {"until": ["\n"], "max_gen_toks": 24}),
            ("Count: one, two, three,", {"until": ["five"], "max_gen_toks": 12})]
    alone = lm(loaded, batch_size=1).generate_until(requests("generate_until", args), disable_tqdm=True)
    batched = lm(loaded, QUANTIZED, batch_size=3).generate_until(requests("generate_until", args), disable_tqdm=True)
    assert "Paris" in alone[0] and "\n" not in alone[0]
    assert "five" not in alone[2]
    fp16_batched = lm(loaded, batch_size=3).generate_until(requests("generate_until", args), disable_tqdm=True)
    assert fp16_batched == alone
    assert len(batched) == 3


def test_a_stopped_run_resumes_from_lm_evals_response_cache(loaded, tmp_path, monkeypatch):
    """Every result reaches lm-eval's response cache (--use_cache) when its batch is done: a run stopped after
    its first batch keeps that batch, and the run again computes only the rest."""
    from lm_eval.api.model import CachingLM

    import kvzoo.eval.requests as requests_module

    args = [("Q: What is the capital of France?\nA:", {"until": ["\n"], "max_gen_toks": 8}),
            ("Q: What is the capital of Italy?\nA:", {"until": ["\n"], "max_gen_toks": 8}),
            ("Count: one, two, three,", {"until": ["five"], "max_gen_toks": 8})]
    want = lm(loaded, batch_size=2).generate_until(requests("generate_until", args), disable_tqdm=True)
    db = str(tmp_path / "responses.db")
    real, calls = requests_module.generate, []

    def stopping(*a, **kw):                     # the second batch is stopped (the user's ^C)
        calls.append(len(a[2]))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(requests_module, "generate", stopping)
    with pytest.raises(KeyboardInterrupt):
        CachingLM(lm(loaded, batch_size=2), db).generate_until(requests("generate_until", args))
    calls.clear()
    assert CachingLM(lm(loaded, batch_size=2), db).generate_until(requests("generate_until", args)) == want
    assert calls == [1]                          # only the request the stopped run had not finished

    pairs = requests("loglikelihood", PAIRS[:2])
    scores = CachingLM(lm(loaded), db).loglikelihood(pairs)
    monkeypatch.setattr(KvzooLM, "_score_batch", lambda *a: pytest.fail("scored again"))
    assert CachingLM(lm(loaded), db).loglikelihood(pairs) == scores


def test_chat_template_is_the_models(loaded):
    harness = lm(loaded)
    text = harness.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "Hi" in text and harness.chat_template(True) == loaded[1].chat_template


# ---- the harness end to end ---------------------------------------------------------------------------
def mc_task(folder: Path) -> Path:
    """A multiple-choice task from local data: GSM8K questions, the right final answer among three numbers."""
    rows = []
    for r in gsm8k()["test"].select(range(4)):
        answer = int(r["answer"].split("####")[-1].replace(",", ""))
        rows.append({"question": r["question"], "choices": [str(answer), str(answer + 7), str(answer * 3 + 1)],
                     "label": 0})
    (folder / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "kvzoo_test_mc.yaml").write_text(
        "task: kvzoo_test_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'mc.jsonl'}\noutput_type: multiple_choice\ntest_split: test\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n")
    return folder


@pytest.mark.slow
def test_harness_runs_the_offline_tasks_end_to_end(loaded, tmp_path):
    """simple_evaluate with the kvzoo model: a local multiple-choice task, kvzoo_wikitext (rolling) and
    kvzoo_gsm8k_cot (8-shot generation), a document each."""
    manager = TaskManager(include_path=[str(task_dir()), str(mc_task(tmp_path))])
    harness = lm(loaded, QUANTIZED, max_length=256, batch_size=2)
    out = simple_evaluate(model=harness, tasks=["kvzoo_test_mc", "kvzoo_wikitext"], limit=1, task_manager=manager)
    assert 0 <= out["results"]["kvzoo_test_mc"]["acc,none"] <= 1
    assert 1 < out["results"]["kvzoo_wikitext"]["word_perplexity,none"] < 1e4
    out = simple_evaluate(model=harness, tasks=["kvzoo_gsm8k_cot"], limit=1, task_manager=manager,
                          gen_kwargs="max_gen_toks=8")
    assert "exact_match,strict-match" in out["results"]["kvzoo_gsm8k_cot"]
    assert set(harness.kv_report) == {"loglikelihood", "loglikelihood_rolling", "generate_until"}


def test_offline_data(tmp_path):
    data = gsm8k()
    assert (len(data["test"]), len(data["train"])) == (1319, 7473)
    articles = wikitext_articles(" = A = \n\n x\n = = B = = \n y\n = C = \n z\n")
    assert [a.split("\n")[0] for a in articles] == [" = A = ", " = C = "]
    with pytest.raises(FileNotFoundError, match="gsm8k-train data not found at .*set KVZOO_DATA"):
        gsm8k(data_dir=str(tmp_path))


def test_script_without_lm_eval_says_how_to_install():
    """scripts/harness.py where lm_eval cannot be imported: one line naming the install command."""
    code = ("import sys, runpy; sys.modules['lm_eval'] = None; sys.argv = ['harness.py', '--tasks', 'x'];"
            "runpy.run_path('scripts/harness.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        'error: kvzoo.eval.harness needs EleutherAI\'s lm-evaluation-harness: pip install "lm_eval>=0.4.5" '
        '(or bash scripts/install.sh)']


def split_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/harness_split.py", *args], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2])


@pytest.mark.slow
def test_split_run_answers_as_the_harness_model_does(loaded, tmp_path, monkeypatch, capsys):
    """scripts/harness_split.py: GSM8K requests recorded, answered by `generate` (two rows a batch, a quantized
    cache, its own process as on the GPU machine) and filled into a response cache give, through the harness's
    CachingLM, the kvzoo model's own answers, and the harness scores them without generating. `record` and `fill`
    load no model and run in this process."""
    from lm_eval.api.model import CachingLM

    requests_json, answers_json, db = tmp_path / "requests.json", tmp_path / "answers.json", tmp_path / "cache"
    code, _, err = run_in_process(monkeypatch, capsys, "harness_split.py", "record", "--tasks", "kvzoo_gsm8k_cot",
                                  "--limit", "3", "--gen_kwargs", "max_gen_toks=6", "--out", str(requests_json))
    assert code == 0, err
    proc = split_run("generate", str(requests_json), "--cache", QUANTIZED, "--device", "cpu", "--batch_size", "2",
                     "--out", str(answers_json))
    assert proc.returncode == 0, proc.stderr
    answers = json.loads(answers_json.read_text())
    assert answers["dtype"] == "float32" and 0 < answers["kv_ratio"] < 2
    code, _, err = run_in_process(monkeypatch, capsys, "harness_split.py", "fill", str(answers_json), "--use_cache",
                                  str(db))
    assert code == 0, err

    recorded = json.loads(requests_json.read_text())["requests"]
    instances = requests("generate_until", [(r["context"], r["gen_kwargs"]) for r in recorded])
    direct = lm(loaded, QUANTIZED, batch_size=2)
    want = direct.generate_until(instances, disable_tqdm=True)
    assert want == [answers["answers"][r["key"]] for r in recorded]
    assert direct.kv_report["generate_until"].ratio == pytest.approx(answers["kv_ratio"])

    harness = lm(loaded, QUANTIZED, batch_size=2)
    def generate_until(reqs, disable_tqdm=False):
        assert not reqs, "the harness generated an answer it had in its cache"
        return []

    harness.generate_until = generate_until
    assert CachingLM(harness, f"{db}_rank0.db").generate_until(instances) == want      # the file --use_cache opens
    out = simple_evaluate(model=harness, tasks=["kvzoo_gsm8k_cot"], limit=3, gen_kwargs="max_gen_toks=6",
                          use_cache=str(db), task_manager=TaskManager(include_path=str(task_dir())))
    assert "exact_match,strict-match" in out["results"]["kvzoo_gsm8k_cot"]


def test_split_run_errors(tmp_path, monkeypatch, capsys):
    """Files of the wrong kind, and a response cache holding other answers, are named in one line (in this
    process: each is refused before a model is loaded)."""

    def refused(*args):
        code, _, err = run_in_process(monkeypatch, capsys, "harness_split.py", *args)
        return code, err

    (tmp_path / "x.json").write_text("{}")
    code, err = refused("generate", str(tmp_path / "x.json"), "--device", "cpu", "--out", str(tmp_path / "a.json"))
    assert code == 2 and "holds no requests; give a JSON file `record` wrote" in err
    code, err = refused("fill", str(tmp_path / "x.json"), "--use_cache", str(tmp_path / "c"))
    assert code == 2 and "holds no answers; give a JSON file `generate` wrote" in err
    for text in ("one", "two"):
        (tmp_path / f"{text}.json").write_text(json.dumps({"answers": {"k": text}}))
        code, err = refused("fill", str(tmp_path / f"{text}.json"), "--use_cache", str(tmp_path / "c"))
    assert code == 2 and "already holds other answers for 1 of these requests" in err
    code, err = refused("generate", str(tmp_path / "missing.json"), "--device", "cpu",
                        "--out", str(tmp_path / "a.json"))
    assert code == 2 and "missing.json" in err
    (tmp_path / "r.json").write_text(json.dumps({"requests": []}))
    code, err = refused("generate", str(tmp_path / "r.json"), "--device", "cpu", "--batch_size", "0",
                        "--out", str(tmp_path / "a.json"))
    assert code == 2 and "--batch_size must be >= 1, got 0" in err
    code, err = refused("generate", str(tmp_path / "r.json"), "--device", "cpu", "--cache", "nope",
                        "--out", str(tmp_path / "a.json"))
    assert code == 2 and "nope" in err
    code, err = refused("record", "--tasks", "kvzoo_wikitext", "--limit", "1", "--out", str(tmp_path / "w.json"))
    assert code == 2 and "record takes generation tasks (generate_until)" in err
    code, err = refused("record", "--tasks", "kvzoo_gsm8k_cot", "--limit", "1", "--gen_kwargs", "do_sample=True",
                        "--out", str(tmp_path / "s.json"))
    assert code == 2 and "record takes greedy generation only" in err
    assert not any((tmp_path / f).exists() for f in ("a.json", "w.json", "s.json"))


def test_split_record_without_lm_eval_says_how_to_install(tmp_path):
    code = ("import sys, runpy; sys.modules['lm_eval'] = None; sys.argv = ['harness_split.py', 'record', '--tasks', "
            f"'x', '--out', {str(tmp_path / 'r.json')!r}]; runpy.run_path('scripts/harness_split.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        'error: record needs EleutherAI\'s lm-evaluation-harness: pip install "lm_eval>=0.4.5" (or bash '
        'scripts/install.sh)']
