"""benchmarks/results/*.csv share one schema: the run columns of benchmarks/_common.py
(timestamp in UTC ISO-8601, gpu, torch, moepeak, commit) lead every file, every row has the
header's length, and append_results keeps a file append-only under one header."""
import csv
import datetime
import glob
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _common  # noqa: E402

LEADING = ["timestamp", "gpu", "torch", "moepeak", "commit"]
# A full UTC time to the second, or (rows written before times were kept) to the minute or
# a calendar date alone.
TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}(:\d{2})?\+00:00)?")
COMMIT = re.compile(r"[0-9a-f]{7,40}|unknown")
RESULT_FILES = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.csv")))


def test_the_schema_is_the_writers():
    assert list(_common.RESULT_COLUMNS) == LEADING


def test_there_are_results_files():
    names = {os.path.basename(p) for p in RESULT_FILES}
    assert {"ring_dtp.csv", "llep.csv", "sco.csv", "optim.csv", "demo_reach.csv"} <= names, names


@pytest.mark.parametrize("path", RESULT_FILES, ids=os.path.basename)
def test_results_file_schema(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    assert header[:len(LEADING)] == LEADING, header
    assert len(header) > len(LEADING) and len(set(header)) == len(header), header
    assert body, f"{path} has a header and no rows"
    for n, row in enumerate(body, start=2):
        assert len(row) == len(header), f"{path}:{n}: {len(row)} fields, header has {len(header)}"
        ts, gpu, torch_version, _, commit = row[:len(LEADING)]
        assert TIMESTAMP.fullmatch(ts), f"{path}:{n}: timestamp {ts!r} is not UTC ISO-8601"
        stamp = datetime.datetime.fromisoformat(ts)
        assert datetime.datetime(2020, 1, 1) <= stamp.replace(tzinfo=None), f"{path}:{n}: {ts}"
        assert gpu and torch_version, f"{path}:{n}: empty gpu or torch column"
        assert COMMIT.fullmatch(commit), f"{path}:{n}: commit {commit!r}"


def test_append_results_writes_the_schema_and_stays_append_only(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPEAK_COMMIT", "abc1234")
    path = _common.append_results(str(tmp_path), "widget", [{"T": 8, "ms": "1.50"}, {"T": 16}], gpu="GPU X")
    assert path == str(tmp_path / "widget.csv")
    _common.append_results(str(tmp_path), "widget", [{"ms": "2.25", "T": 32}])  # the file's column order
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == LEADING + ["T", "ms"]
    assert [(r["T"], r["ms"]) for r in rows] == [("8", "1.50"), ("16", ""), ("32", "2.25")]
    assert [(r["gpu"], r["commit"]) for r in rows[:2]] == [("GPU X", "abc1234")] * 2
    for r in rows:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\+00:00", r["timestamp"]), r["timestamp"]
    with pytest.raises(ValueError, match="append-only"):
        _common.append_results(str(tmp_path), "widget", [{"T": 1}], fields=["T", "ms", "extra"])
    with pytest.raises(ValueError, match=r"\['extra'\] are not among fields"):
        _common.append_results(str(tmp_path), "widget", [{"T": 1, "extra": 2}])
    with pytest.raises(ValueError, match="filled in by run_columns"):
        _common.append_results(str(tmp_path), "widget", [{"T": 1, "gpu": "mine"}])
    with pytest.raises(ValueError, match="component must be a bare name"):
        _common.append_results(str(tmp_path), "widget.csv", [{"T": 1}])
    with open(path, newline="") as f:
        assert len(list(csv.reader(f))) == 4  # the refused calls wrote nothing


def test_git_commit_without_a_repository(monkeypatch, tmp_path):
    monkeypatch.delenv("MOEPEAK_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert _common.git_commit(str(tmp_path)) == "unknown"
    assert re.fullmatch(r"[0-9a-f]{7,40}|unknown", _common.git_commit())


def test_git_commit_prefers_moepeak_commit_over_git(monkeypatch):
    # A copy of the tree may carry a stale .git (the GPU machine's does): the environment wins.
    monkeypatch.setenv("MOEPEAK_COMMIT", "feed123")
    assert _common.git_commit() == "feed123"
    assert _common.run_columns(gpu="GPU X")["commit"] == "feed123"


def _load_bench(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_hf_appends_to_the_results_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPEAK_COMMIT", "feed123")
    bench_hf = _load_bench("bench_hf")
    src = os.path.join(ROOT, "benchmarks", "results", "hf.csv")
    copy = tmp_path / "hf.csv"
    copy.write_bytes(open(src, "rb").read())
    with open(src, newline="") as f:
        before = list(csv.reader(f))
    assert before[0] == LEADING + bench_hf.FIELDS
    row = dict(transformers="5.17.0", arm="moepeak", T=8192, status="ok", peak_gib="1.25", step_s="0.500",
               step_s_spread="0.010", tokens_per_s="16384", loss="12.0000", params=123, note="")
    bench_hf.append(str(copy), [row, dict(arm="hf", T=0, status="error", note="boom")])
    with open(copy, newline="") as f:
        after = list(csv.reader(f))
    assert after[:len(before)] == before
    assert len(after) == len(before) + 2
    new = dict(zip(after[0], after[-2]))
    assert new["commit"] == "feed123" and new["arm"] == "moepeak" and new["T"] == "8192"
    assert new["params"] == "123" and new["tokens_per_s"] == "16384"
    err = dict(zip(after[0], after[-1]))
    assert (err["arm"], err["status"], err["note"], err["peak_gib"]) == ("hf", "error", "boom", "")


def test_bench_titan_writes_the_schema(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPEAK_COMMIT", "feed123")
    bench_titan = _load_bench("bench_titan")
    row = dict(job="stock", T=64, status="ok", peak_gib="0.000", step_s_median="0.1000", step_s_spread="0.0000",
               tokens_per_s="640.0")
    path = str(tmp_path / "titan.csv")
    bench_titan.append(path, [row])
    bench_titan.append(path, [dict(job="moepeak", T=64, status="oom")])
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == LEADING + bench_titan.FIELDS
    assert [(r["job"], r["status"], r["commit"]) for r in rows] == [("stock", "ok", "feed123"),
                                                                     ("moepeak", "oom", "feed123")]
