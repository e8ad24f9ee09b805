"""`soap execute --dataset PATH --tokenizer DIR`: the user's text, tokenized, packed and cached.

A tiny word-level tokenizer is trained here on a few sentences and saved as a PreTrainedTokenizerFast
directory; the datasets are written on the fly (no Hub). Every accepted format packs to the same token
file: the documents' ids, each followed by EOS, cut to whole windows of seq_len + 1. A second call reads
the cache; a 2-rank `soap execute` trains on it; without `datasets` installed the flag is one clear error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from exec_helpers import make_plan

from executor.data import prepare_dataset
from soap.cli import main
from tracer.errors import SoapError

pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the a cat dog sat ran on under mat log quick brown fox jumps over lazy".split()
DOCUMENTS = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(5 + i % 7)) for i in range(40)]
SEQ_LEN = 16


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCUMENTS, trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    return path


def expected_tokens(tokenizer_dir: Path) -> np.ndarray:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    stream = [i for doc in DOCUMENTS for i in tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    span = SEQ_LEN + 1
    return np.asarray(stream[:len(stream) // span * span])


def write_dataset(kind: str, root: Path) -> Path:
    import datasets

    rows = [{"text": d, "id": i} for i, d in enumerate(DOCUMENTS)]
    if kind == "saved":
        datasets.Dataset.from_list(rows).save_to_disk(root / "saved")
        return root / "saved"
    if kind == "saved-dict":
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(root / "saved-dict")
        return root / "saved-dict"
    if kind == "jsonl":
        (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return root / "data.jsonl"
    if kind == "json-dir":  # a directory of files, read in name order
        (root / "parts").mkdir()
        for k in range(2):
            (root / "parts" / f"{k}.json").write_text("".join(json.dumps(r) + "\n" for r in rows[k * 20:(k + 1) * 20]))
        return root / "parts"
    if kind == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(root / "data.parquet")
        return root / "data.parquet"
    (root / "data.txt").write_text("\n".join(DOCUMENTS) + "\n")
    return root / "data.txt"


@pytest.mark.parametrize("kind", ["saved", "saved-dict", "jsonl", "json-dir", "parquet", "text"])
def test_every_format_packs_to_the_same_tokens(kind, tokenizer_dir, tmp_path):
    path = prepare_dataset(write_dataset(kind, tmp_path), tokenizer_dir, SEQ_LEN, cache_dir=tmp_path / "cache")
    tokens = np.load(path)
    assert tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, expected_tokens(tokenizer_dir))
    info = json.loads(path.with_suffix(".json").read_text())
    assert info["documents"] == len(DOCUMENTS) and info["column"] == "text"
    assert info["sequences"] == len(tokens) // (SEQ_LEN + 1)


def test_second_call_reads_the_cache_and_a_new_seq_len_does_not(tokenizer_dir, tmp_path, monkeypatch):
    data = write_dataset("jsonl", tmp_path)
    first = prepare_dataset(data, tokenizer_dir, SEQ_LEN, cache_dir=tmp_path / "cache")
    monkeypatch.setattr("executor.data._tokenize", lambda *a: pytest.fail("tokenized again"))
    assert prepare_dataset(data, tokenizer_dir, SEQ_LEN, cache_dir=tmp_path / "cache") == first
    monkeypatch.undo()
    assert prepare_dataset(data, tokenizer_dir, SEQ_LEN * 2, cache_dir=tmp_path / "cache") != first


def test_missing_datasets_package_is_one_clear_error(tokenizer_dir, tmp_path, monkeypatch):
    data = write_dataset("text", tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    with pytest.raises(SoapError, match=r"--dataset needs the `datasets` package: pip install -e '\.\[data\]' in "
                                        r"the soap checkout \(`soap` on PyPI is another project\)"):
        prepare_dataset(data, tokenizer_dir, SEQ_LEN, cache_dir=tmp_path / "cache")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_tokenizing(tokenizer_dir, tmp_path, monkeypatch):
    data = write_dataset("text", tmp_path)
    monkeypatch.setattr("executor.data._tokenize", lambda *a: pytest.fail("tokenized a dataset it cannot train on"))
    size = len(WORDS) + 2  # the words and <unk>, </s>
    with pytest.raises(SoapError, match=rf"--tokenizer {tokenizer_dir}: {size} tokens, more than the model's "
                                        r"vocabulary of 10; use the model's own tokenizer"):
        prepare_dataset(data, tokenizer_dir, SEQ_LEN, cache_dir=tmp_path / "cache", vocab_size=10)


def test_too_little_text_and_ambiguous_columns_are_errors(tokenizer_dir, tmp_path):
    (tmp_path / "short.txt").write_text("the cat\n")
    with pytest.raises(SoapError, match="fewer than one sequence of 17"):
        prepare_dataset(tmp_path / "short.txt", tokenizer_dir, SEQ_LEN, cache_dir=tmp_path / "cache")
    (tmp_path / "two.jsonl").write_text(json.dumps({"prompt": "the cat", "answer": "sat"}) + "\n")
    with pytest.raises(SoapError, match="no `text` column and 2 string columns"):
        prepare_dataset(tmp_path / "two.jsonl", tokenizer_dir, SEQ_LEN, cache_dir=tmp_path / "cache")


def test_dataset_needs_a_tokenizer(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    make_plan("llama", dp_shard=2, zero=3).save(plan)
    assert main(["execute", str(plan), "--dataset", str(tmp_path)]) == 2
    assert "--dataset PATH needs --tokenizer DIR" in capsys.readouterr().err


@pytest.mark.slow
def test_execute_trains_two_ranks_on_a_dataset_and_saves_an_hf_model(tokenizer_dir, tmp_path):
    plan = tmp_path / "plan.json"
    make_plan("llama", dp_shard=2, zero=3, micro_batch=2, seq_len=SEQ_LEN).save(plan)
    data = write_dataset("jsonl", tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    proc = subprocess.run(
        [sys.executable, "-m", "soap", "execute", str(plan), "--steps", "2", "--dataset", str(data),
         "--tokenizer", str(tokenizer_dir), "--save-hf", str(tmp_path / "hf"), "--report", str(tmp_path / "run.json"),
         "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads(proc.stdout)["losses"]
    assert len(losses) == 2 and all(np.isfinite(losses))
    cached = list((tmp_path / "xdg" / "soap" / "datasets").glob("tokens-*.npy"))
    assert len(cached) == 1
    np.testing.assert_array_equal(np.load(cached[0]), expected_tokens(tokenizer_dir))
    saved = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= saved, saved
    assert f"wrote {tmp_path / 'hf'}: config.json, model.safetensors and the tokenizer from {tokenizer_dir}" \
        in proc.stderr
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # as save_pretrained
