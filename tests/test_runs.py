"""Run directories (probekit/runs.py): identity, the one resumable loop, verified parts,
the folder lock. Faults are injected directly into the files a run wrote."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from probekit.runs import RunDir, added_later, file_hash, identity, not_identity


@dataclasses.dataclass(frozen=True)
class Inner:
    a: int = 1
    threads: int | None = not_identity(None)


@dataclasses.dataclass(frozen=True)
class Cfg:
    inner: Inner = Inner()
    b: float = 0.5
    run_dir: str | None = not_identity(None)


@dataclasses.dataclass(frozen=True)
class Later:
    b: float = 0.5
    c: float = added_later(0.0)


def test_identity_keeps_result_fields_and_drops_marked_ones():
    assert identity(Cfg(Inner(2, threads=4), 0.1, run_dir="x")) == {"inner": {"a": 2}, "b": 0.1}
    assert identity(Cfg(Inner(threads=1))) == identity(Cfg(Inner(threads=8), run_dir="y"))


def test_a_field_added_later_enters_the_identity_only_when_set():
    # results keyed before the field existed keep their keys; a set value changes them
    assert identity(Later()) == {"b": 0.5} == identity(Later(c=0.0))
    assert identity(Later(c=0.1)) == {"b": 0.5, "c": 0.1}


def test_folder_name_follows_config_model_and_input_contents(tmp_path):
    text = tmp_path / "c.txt"
    text.write_text("one")
    a = RunDir.open("cmd", Cfg(), inputs={"text": text}, root=tmp_path)
    assert RunDir.open("cmd", Cfg(Inner(threads=3)), inputs={"text": text}, root=tmp_path
                       ).path == a.path  # threads are not part of the identity
    assert RunDir.open("cmd", Cfg(b=0.2), inputs={"text": text}, root=tmp_path).path != a.path
    text.write_text("two")  # same path, new content: a new run, never the old results
    assert RunDir.open("cmd", Cfg(), inputs={"text": text}, root=tmp_path).path != a.path


def test_explicit_run_dir_with_other_inputs_is_refused(tmp_path):
    text = tmp_path / "c.txt"
    text.write_text("one")
    RunDir.open("cmd", Cfg(), inputs={"text": text}, path=tmp_path / "r")
    text.write_text("two")
    with pytest.raises(ValueError, match="holds a run with a different config or inputs"):
        RunDir.open("cmd", Cfg(), inputs={"text": text}, path=tmp_path / "r")


def test_file_hash_of_folder_covers_names_and_bytes(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_bytes(b"1")
    h = file_hash(tmp_path / "d")
    (tmp_path / "d" / "x").write_bytes(b"2")
    assert file_hash(tmp_path / "d") != h


def _units(n=4):
    return [(f"u{i}", i) for i in range(n)]


def _square(calls):
    def compute(i):
        calls.append(i)
        return {"x": np.arange(3) * i}
    return compute


def test_map_computes_once_and_resumes(tmp_path):
    run = RunDir.open("cmd", Cfg(), path=tmp_path / "r")
    calls: list[int] = []
    first = run.map(_units(), _square(calls), progress=False)
    assert calls == [0, 1, 2, 3]
    (run.path / "parts" / "u2.npz").unlink()  # as if killed before unit 2 was saved
    again = run.map(_units(), _square(calls), progress=False)
    assert calls == [0, 1, 2, 3, 2]
    assert all(np.array_equal(first[k]["x"], again[k]["x"]) for k in first)
    assert set(again["u1"]) == {"x"}  # the unit key stored in the part is not handed back


def test_map_rejects_duplicate_keys(tmp_path):
    run = RunDir.open("cmd", Cfg(), path=tmp_path / "r")
    with pytest.raises(ValueError, match="unit keys must be unique"):
        run.map([("a", 1), ("a", 2)], _square([]), progress=False)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "swap", "flip", "unrecorded"])
def test_damaged_or_foreign_parts_are_recomputed_with_a_warning(tmp_path, damage):
    run = RunDir.open("cmd", Cfg(), path=tmp_path / "r")
    calls: list[int] = []
    clean = run.map(_units(), _square(calls), progress=False)
    part = run.path / "parts" / "u1.npz"
    data = part.read_bytes()
    if damage == "truncate":
        part.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        part.write_bytes(b"not a zip file")
    elif damage == "swap":  # a valid part of another unit
        part.write_bytes((run.path / "parts" / "u3.npz").read_bytes())
    elif damage == "flip":  # same length, one byte changed inside the array data
        i = data.index(np.asarray(np.arange(3) * 1).tobytes()) + 8
        part.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    else:  # a part the index never recorded (e.g. copied in from another run folder)
        index = run.path / "parts" / "index.jsonl"
        index.write_text("".join(line + "\n" for line in index.read_text().splitlines()
                                 if json.loads(line)["key"] != "u1"))
    with pytest.warns(UserWarning, match=r"u1\.npz (is damaged|belongs to another unit|does "
                                         r"not match the checksum)"):
        again = run.map(_units(), _square(calls), progress=False)
    assert 1 in calls[4:]
    for k in clean:
        assert np.array_equal(clean[k]["x"], again[k]["x"])


def test_garbage_config_and_file_run_dir_are_one_line_errors(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        RunDir.open("cmd", Cfg(), path=tmp_path / "r")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file; give a folder"):
        RunDir.open("cmd", Cfg(), path=tmp_path / "f")


def test_fresh_forgets_finished_parts(tmp_path):
    run = RunDir.open("cmd", Cfg(), path=tmp_path / "r")
    calls: list[int] = []
    run.map(_units(2), _square(calls), progress=False)
    run = RunDir.open("cmd", Cfg(), path=tmp_path / "r", fresh=True)
    run.map(_units(2), _square(calls), progress=False)
    assert calls == [0, 1, 0, 1]


def test_a_second_run_waits_for_the_first_and_reuses_its_parts(tmp_path):
    """Two identical runs at once: the second blocks on the folder lock, then computes
    nothing because every part is already there. Timing-free: the first run's units wait
    for a go-file that is only created once the second has said it is waiting."""
    go = tmp_path / "go"
    script = textwrap.dedent(f"""
        import json, os, sys, time
        import numpy as np
        from probekit.runs import RunDir
        run = RunDir.open("cmd", {{"a": 1}}, path={str(tmp_path / "r")!r})
        print("locked", flush=True)
        calls = []
        def compute(i):
            calls.append(i)
            while sys.argv[1] == "first" and not os.path.exists({str(go)!r}):
                time.sleep(0.02)
            return {{"x": np.array(i)}}
        run.map([(f"u{{i}}", i) for i in range(3)], compute, progress=False)
        print(json.dumps(calls))
    """)
    first = subprocess.Popen([sys.executable, "-c", script, "first"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert first.stdout.readline().strip() == "locked"
    second = subprocess.Popen([sys.executable, "-c", script, "second"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    waiting = second.stderr.readline()  # blocks until the second reports the lock
    assert "waiting for it to finish" in waiting
    go.touch()
    out1, _ = first.communicate(timeout=120)
    out2, _ = second.communicate(timeout=120)
    assert json.loads(out1.splitlines()[-1]) == [0, 1, 2]
    assert out2.splitlines()[0] == "locked" and json.loads(out2.splitlines()[-1]) == []


def test_warnings_are_clean_lines_in_the_cli(tmp_path, capsys):
    from probekit.commands.main import one_line_warnings

    with one_line_warnings(), warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("runs/x/parts/u1.npz is damaged (BadZipFile); recomputing it",
                      stacklevel=1)
    err = capsys.readouterr().err
    assert err == "probekit: warning: runs/x/parts/u1.npz is damaged (BadZipFile); " \
                  "recomputing it\n"
