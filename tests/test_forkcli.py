"""The forked command line (tests/forkcli.py) says what the real command says."""

import subprocess
import sys

import forkcli


def test_a_refused_command_reads_the_same_forked_as_started(tmp_path):
    args = ("--epochs", "0", "--dataset", "digits")
    forked = forkcli.run("app.train", *args, cwd=tmp_path)
    started = subprocess.run([sys.executable, "-m", "app.train", *args], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    assert forked.returncode == started.returncode == 2
    assert (forked.stdout, forked.stderr) == (started.stdout, started.stderr)
    assert "epochs must be >= 1" in forked.stderr


def test_a_crashing_command_comes_back_with_its_traceback(tmp_path):
    # forkcli has no main(): the command fails as any crash would, and the test sees it.
    crashed = forkcli.run("forkcli", cwd=tmp_path)
    assert crashed.returncode == 1
    assert "Traceback" in crashed.stderr and "AttributeError" in crashed.stderr
