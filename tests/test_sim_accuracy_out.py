"""``bench sim_accuracy``'s output files are asked about before any work (stop 74).

Before: ``--resimulate R --profile P --out Y`` re-simulated every workload, printed the table, and only then failed
to write ``Y`` -- under a file, in a folder that takes no file -- with an OSError quoting the path whole (a
traceback from ``main``); a real run failed so after minutes of calibration.  A missing folder is no such error:
the writer makes it, as it always did.  Oracle: the file system itself (a plain file as the folder, ``/proc``,
a folder made read-only), and whether the work (``read_result``, ``run``) was reached at all.
"""

from __future__ import annotations

import glob
import os
import stat

import pytest

from minivllm.bench import sim_accuracy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*cpu-2core_sim_accuracy*.json")))[-1]


def _no_work(monkeypatch):
    """Make any work fail the test: reading the result to re-simulate, or a real run."""
    def reached(*a, **k):
        raise AssertionError("the work began before the output file was asked about")
    monkeypatch.setattr(sim_accuracy, "read_result", reached)
    monkeypatch.setattr(sim_accuracy, "run", reached)


def _refused(argv, capsys, *needles):
    with pytest.raises(SystemExit) as exc:
        sim_accuracy.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert exc.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert all(n in lines[0] for n in needles), err
    return lines[0]


@pytest.mark.parametrize("under", ["r.json", "deeper/r.json"])
def test_an_out_under_a_plain_file_is_refused_before_the_resimulation(tmp_path, monkeypatch, capsys, under):
    (tmp_path / "notes").write_text("a file, not a folder")
    out = tmp_path / "notes" / under
    _no_work(monkeypatch)
    _refused(["--resimulate", RESULT, "--profile", "cpu-2core", "--out", str(out)], capsys,
             "argument --out", f"{str(tmp_path / 'notes')!r} is not a directory")
    assert (tmp_path / "notes").read_text() == "a file, not a folder"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, which takes no new file")
def test_an_out_in_a_folder_that_takes_no_file_is_refused_before_the_resimulation(monkeypatch, capsys):
    _no_work(monkeypatch)
    _refused(["--resimulate", RESULT, "--profile", "cpu-2core", "--out", "/proc/r.json"], capsys,
             "argument --out", "'/proc' takes no new file")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes in a read-only folder")
def test_an_out_in_a_read_only_folder_is_refused(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        _no_work(monkeypatch)
        _refused(["--resimulate", RESULT, "--profile", "cpu-2core", "--out", str(folder / "r.json")], capsys,
                 "takes no new file")
    finally:
        folder.chmod(stat.S_IRWXU)


@pytest.mark.parametrize("flag", ["--out", "--save-profile"])
def test_a_real_run_is_refused_before_it_calibrates(tmp_path, monkeypatch, capsys, flag):
    (tmp_path / "notes").write_text("")
    _no_work(monkeypatch)
    _refused([flag, str(tmp_path / "notes" / "r.json")], capsys, f"argument {flag}", "is not a directory")


def test_an_out_in_a_missing_folder_is_still_made_and_written(tmp_path, capsys):
    """The writer makes a missing folder (``write_json``): the check refuses only what it cannot write."""
    out = tmp_path / "new" / "sub" / "r.json"
    assert sim_accuracy.main(["--resimulate", RESULT, "--profile", "cpu-2core", "--out", str(out)]) == 0
    assert out.is_file() and f"wrote {out}" in capsys.readouterr().out


def test_a_dead_link_is_asked_of_the_folder_it_points_into(tmp_path, monkeypatch, capsys):
    """The review of cd7b295: a link was written through unasked, so one pointing into a missing root folder ran
    the whole re-simulation and then failed.  A live link (``/dev/stdout``'s kind) is still written through."""
    (tmp_path / "notes").write_text("a file, not a folder")
    dead = tmp_path / "dead.json"
    dead.symlink_to(tmp_path / "notes" / "r.json")
    _no_work(monkeypatch)
    _refused(["--resimulate", RESULT, "--profile", "cpu-2core", "--out", str(dead)], capsys,
             "argument --out", f"{str(tmp_path / 'notes')!r} is not a directory")
    live = tmp_path / "live.json"
    live.symlink_to("/dev/null")
    assert sim_accuracy.unwritable(str(live)) is None


def test_save_profile_beside_profile_is_refused_as_unread_first(tmp_path, capsys):
    """A --save-profile a --profile run never writes is refused for that, not for its path."""
    _refused(["--profile", "cpu-2core", "--save-profile", "/proc/p.json"], capsys, "with --profile")
