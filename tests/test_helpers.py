"""The test helper that bounds a wait for a child's line: ``readline_within``."""

import subprocess
import sys
import time

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
