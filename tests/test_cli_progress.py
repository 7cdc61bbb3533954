"""Progress lines of long CLI work: the time left against a closed form, plain lines in a log, a live
bar on a terminal (the ``train`` command's lines: tests/test_train_examples.py)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from polyparallel import _cli_progress
from polyparallel._cli_progress import LineProgress


def _clock(monkeypatch: pytest.MonkeyPatch, times: list[float]) -> None:
    it = iter(times)
    monkeypatch.setattr(_cli_progress.time, "monotonic", lambda: next(it))


def test_plain_lines_carry_the_time_left_from_the_pace_after_the_first_unit(monkeypatch):
    # units end at t = 100 (start-up included), 101, 103: 1.5 s per unit since the first, 2 units left
    _clock(monkeypatch, [100.0, 101.0, 103.0, 104.0])
    out = io.StringIO()
    with LineProgress(5, "steps", console=Console(file=out, force_terminal=False, width=80)) as p:
        for i in range(4):
            p.line(f"unit {i}")
    lines = out.getvalue().splitlines()
    assert lines[0] == "unit 0" and lines[1] == "unit 1  eta 3.0 s"  # 1 s/unit x 3 left
    assert lines[2] == "unit 2  eta 3.0 s"  # (103 - 100) / 2 x 2 left
    assert lines[3] == "unit 3  eta 1.3 s"  # 4 s / 3 x 1 left
    assert "\x1b[" not in out.getvalue()  # a log gets no control codes


def test_a_resumed_run_estimates_from_the_units_this_process_saw(monkeypatch):
    _clock(monkeypatch, [0.0, 2.0])
    out = io.StringIO()
    with LineProgress(100, "steps", console=Console(file=out, force_terminal=False)) as p:
        p.line("step 60", done=61)
        p.line("step 61", done=62)
    assert out.getvalue().splitlines()[1].endswith("eta 76.0 s")  # 2 s per step x 38 left, not 2/61


def test_the_last_unit_has_no_time_left():
    out = io.StringIO()
    with LineProgress(2, "rounds", console=Console(file=out, force_terminal=False)) as p:
        p.line("round 1/2")
        p.line("round 2/2")
    assert "eta" not in out.getvalue()


def test_a_terminal_gets_the_lines_and_a_live_bar():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with LineProgress(3, "rounds", console=console) as p:
        assert p.live
        for r in range(1, 4):
            p.line(f"round {r}/3  accepted a,b", done=r)
    text = out.getvalue()
    for r in range(1, 4):
        assert f"round {r}/3  accepted a,b" in text
    assert "\x1b[" in text and "rounds" in text  # the bar was drawn (and cleared: transient)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_ctrl_c_exits_130_with_a_line():
    """Ctrl-C in a long search: exit 130 with one line (click's own handling exited 130 silently)."""
    import signal
    import subprocess
    import sys
    import time

    argv = ["search", "gpt3-175b", "-c", "dgx-a100x192", "--exhaustive"]
    p = subprocess.Popen([sys.executable, "-m", "polyparallel", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(6)  # mid-search: an exhaustive search of GPT-3 on 1536 GPUs runs far longer
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted (Ctrl-C)")


def test_a_long_unit_in_a_log_gets_a_line_saying_it_is_under_way():
    """Piped output of a unit slower than the heartbeat (Flower's start-up before round 1, a round of
    thousands of local steps): lines saying it is under way, so no log falls silent for longer."""
    import time

    out = io.StringIO()
    with LineProgress(2, "rounds", console=Console(file=out, force_terminal=False), heartbeat_s=0.2) as p:
        time.sleep(1.0)  # five heartbeats' worth
        p.line("round 1/2")
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2 and lines[-1].startswith("round 1/2"), lines
    assert all(ln.startswith("  ... round 1/2 under way (") for ln in lines[:-1]), lines


def test_a_piped_calibration_says_what_runs_when_a_measurement_is_long(capsys: pytest.CaptureFixture[str]) -> None:
    """`polyparallel calibrate` writes a line per measurement; a group of measuring workers can take
    minutes, so piped output gets a line per heartbeat saying what runs and what was done last."""
    import time

    from polyparallel._cli_cluster import _steps

    with _steps("calibrating", heartbeat_s=0.2) as say:
        say("matmul 512x512: 10 GFLOP/s")
        time.sleep(0.7)
    err = capsys.readouterr().err.splitlines()
    assert err[0].strip() == "matmul 512x512: 10 GFLOP/s"
    beats = [line for line in err[1:] if line.strip().startswith("... calibrating")]
    assert beats and "last done: matmul 512x512" in beats[0]
