"""nbtrain.launch_server.rankpipes: what of a rank's output the cell gets, and the run's log."""

from __future__ import annotations

from nbtrain.kernel import launcher_connection
from nbtrain.launch_server import rankpipes
from nbtrain.launch_server.rankpipes import OutputLimits, RankOutput, RunLog
from nbtrain.messages import events

SMALL = OutputLimits(line_chars=10, head_lines=3, head_chars=1000, tail_lines=2, tail_chars=100)


def texts(pieces):
    return "".join(text for _, text in pieces)


def test_a_long_line_arriving_in_chunks_is_cut_once_with_the_count(tmp_path):
    log = RunLog(str(tmp_path / "run.log"))
    out = RankOutput(0, log, SMALL)
    shown = out.feed("stdout", b"a" * 7) + out.flush("stdout") + out.feed("stdout", b"a" * 20)
    shown += out.flush("stdout")  # the line is past its limit: it waits for its end
    shown += out.feed("stdout", b"a" * 5 + b"\nok\n")
    marker = f" … [22 more characters cut from this line; all of it is in {log.path}]"
    assert texts(shown) == "a" * 10 + marker + "\nok\n"
    log.close()
    assert (tmp_path / "run.log").read_bytes() == b"[rank 0] " + b"a" * 32 + b"\n[rank 0] ok\n"


def test_the_head_then_a_note_then_only_the_last_lines_at_the_end():
    out = RankOutput(1, None, SMALL)
    shown = out.feed("stdout", b"".join(b"%d\n" % i for i in range(10)))
    assert shown[0] == ("stdout", "0\n1\n2\n")
    assert shown[1][0] == "stderr"
    assert shown[1][1].startswith("nbtrain: rank 1 printed more than the cell shows (3 lines")
    assert out.skipped() == (3 + 5, (("stdout", "8\n"), ("stdout", "9\n")))
    assert out.skipped() is None  # nothing new
    shown = out.feed("stderr", b"err\n") + out.finish()
    assert shown[0] == ("stderr", "nbtrain: 6 lines of rank 1 (12 characters) are not shown; its last 2 follow.\n")
    assert shown[1:] == [("stdout", "9\n"), ("stderr", "err\n")]


def test_the_tail_is_bounded_in_characters_too():
    out = RankOutput(0, None, OutputLimits(line_chars=100, head_lines=0, tail_lines=10, tail_chars=25))
    out.feed("stdout", b"".join(b"%09d\n" % i for i in range(5)))  # 10 characters a line
    assert [text for _, text in out.tail] == ["000000003\n", "000000004\n"]
    assert out.omitted_lines == 3


def test_a_stream_ending_without_a_newline_is_flushed_whole(tmp_path):
    log = RunLog(str(tmp_path / "run.log"))
    out = RankOutput(2, log, SMALL)
    out.feed("stderr", "héllo".encode()[:2])  # a character split between two reads
    assert texts(out.feed("stderr", "héllo".encode()[2:]) + out.finish()) == "héllo"
    log.close()
    assert (tmp_path / "run.log").read_text() == "[rank 2 stderr] héllo\n"


def test_a_run_that_prints_nothing_leaves_no_log(tmp_path):
    log = RunLog(str(tmp_path / "run.log"))
    RankOutput(0, log, SMALL).finish()
    log.close()
    assert not (tmp_path / "run.log").exists()


def test_old_run_logs_are_pruned_as_a_run_s_log_closes(monkeypatch, tmp_path):
    """Off the way to the next run's start: the launcher prunes when a run's log closes."""
    monkeypatch.setattr(rankpipes, "LOGS_KEPT", 3)
    for i in range(5):
        (tmp_path / f"run-2026010{i}-000000-1-1.log").write_text("x")
    (tmp_path / "notes.txt").write_text("not a log")
    log = RunLog(str(tmp_path / "run-20260109-000000-1-7.log"))
    log.close()  # it printed nothing: no file, and nothing pruned
    assert len(list(tmp_path.iterdir())) == 6
    log = RunLog(str(tmp_path / "run-20260109-000000-1-7.log"))
    log.write(0, "stdout", b"a line\n")
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt",
        "run-20260103-000000-1-1.log",
        "run-20260104-000000-1-1.log",
        "run-20260109-000000-1-7.log",
    ]


def test_the_kernel_drops_output_nobody_takes_and_says_so():
    pending = launcher_connection._PendingOutput("/logs/run.log")
    line = events.Output(1, 0, "stdout", "x" * 99 + "\n")
    admitted = sum(pending.admit(line) for _ in range(launcher_connection.PENDING_OUTPUT_CHARS // 100 + 10))
    assert admitted == launcher_connection.PENDING_OUTPUT_CHARS // 100 + 1  # then the bound holds
    assert pending.notes(1) == []  # still behind: no note yet
    pending.taken(pending.chars)
    (note,) = pending.notes(1)
    assert note.text == (
        "nbtrain: 9 lines of rank 0 were not shown: the notebook could not keep up. Every line is in /logs/run.log.\n"
    )
