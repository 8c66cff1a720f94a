"""The test helper that bounds a wait for a child's line: ``readline_within``."""

import subprocess
import sys
import time

import helpers
import pytest
from helpers import CHILD_TIMEOUT_S, child, readline_within


def test_readline_within_reads_text_and_binary_lines_and_stops_at_end_of_file():
    code = "import sys\nprint('one')\nprint('two')\nsys.stdout.write('tail')\n"
    with child(code) as proc:
        assert readline_within(proc.stdout, 10, "one") == "one\n"
        assert readline_within(proc.stdout, 10, "two") == "two\n"
        assert readline_within(proc.stdout, 10, "the tail") == "tail"
        assert readline_within(proc.stdout, 10, "end of file") == ""
    proc = subprocess.Popen([sys.executable, "-c", "print('ready')"], stdout=subprocess.PIPE)
    try:
        assert readline_within(proc.stdout, 10, "ready") == b"ready\n"
    finally:
        proc.kill()
        proc.communicate(timeout=CHILD_TIMEOUT_S)


def test_readline_within_names_what_it_waited_for_when_no_line_comes():
    code = "import sys, time\nsys.stdout.write('ready\\nhalf')\nsys.stdout.flush()\ntime.sleep(60)\n"
    with child(code) as proc:
        assert readline_within(proc.stdout, 10, "ready") == "ready\n"
        began = time.monotonic()
        with pytest.raises(AssertionError, match=r"waited 0.3 s for the child's greeting; got b'half'"):
            readline_within(proc.stdout, 0.3, "the child's greeting")
        assert time.monotonic() - began < 5


def test_chi2_matches_known_quantiles():
    assert helpers.chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-6)
    assert helpers.chi2_sf(310.4573882199318, 255) == pytest.approx(0.01, rel=1e-6)
    assert helpers.chi2_p([60, 40], [50.0, 50.0]) == pytest.approx(0.0455003, rel=1e-5)
    # bins expected under 5 are pooled: [3, 1] against [2, 2] is one bin of 4 against 4
    assert helpers.chi2_p([90, 3, 1], [90.0, 2.0, 2.0]) == pytest.approx(1.0)
