"""`soap plan` skips the interpreter's teardown on success (`soap.cli.process_main`) without losing output."""

import json
import subprocess
import sys


def test_fast_exit_keeps_stdout_the_plan_file_and_exit_handlers(tmp_path):
    plan, marker = tmp_path / "plan.json", tmp_path / "atexit-ran"
    code = ("import atexit, pathlib, sys\n"
            f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'yes')\n"
            f"sys.argv = ['soap', 'plan', 'gpt2', '--gpus', '8', '--json', '-o', {str(plan)!r}]\n"
            "from soap.cli import process_main\n"
            "process_main()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["gpus"] == 8
    assert json.loads(plan.read_text())["mesh"]
    assert marker.read_text() == "yes"


def test_failures_still_exit_with_their_code():
    done = subprocess.run([sys.executable, "-m", "soap", "plan", "gpt2", "--gpus", "3", "--tp", "5"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: ")
