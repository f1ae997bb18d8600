"""Every command's bad input ends the same way: one line `<script>: error: <message>` on stderr
(argparse's own form, <script> the file run), nothing on stdout, exit status 2. Run as users run
them, each with a missing file (the command's own check) and an unknown flag (argparse's)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MISSING = {  # a file that is not there, where each command first reads one
    "launch.py": ["--config", "nope.yaml"],
    "tools/bench.py": ["--config", "nope.yaml"],
    "tools/bench_data.py": ["--config", "nope.yaml"],
    "tools/commbench.py": ["--config", "nope.yaml"],
    "tools/convert_hf.py": ["import", "nope", "out"],
    "tools/doctor.py": ["--config", "nope.yaml"],
    "tools/generate.py": ["nope", "--tokens", "1"],
    "tools/inspect_ckpt.py": ["nope"],
    "tools/plan.py": ["--gpus", "8", "--config", "nope.yaml"],
    "tools/plot.py": ["nope"],
    "tools/prepare_data.py": ["nope.txt", "--out", "ds", "--tokenizer", "nope.model"],
}


def test_every_command_is_listed():
    scripts = {str(p.relative_to(ROOT)) for p in [ROOT / "launch.py", *ROOT.glob("tools/*.py")]
               if "sys.exit(main())" in p.read_text()}
    assert scripts == set(MISSING)


@pytest.mark.parametrize("script", sorted(MISSING))
def test_bad_input_is_one_line_naming_the_script(tmp_path, script):
    name = Path(script).name
    runs = [subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=tmp_path, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for args in (MISSING[script], [*MISSING[script], "--no-such-flag"])]
    for run, says in zip(runs, ("nope", "unrecognized arguments: --no-such-flag")):
        out, err = run.communicate(timeout=300)
        assert (run.returncode, out, err.count("\n")) == (2, "", 1), (out, err)
        assert err.startswith(f"{name}: error: ") and says in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_python_without_the_dependencies_is_told_to_activate_the_environment():
    """`python launch.py --help` outside the virtual environment (here: -S, no site-packages)
    was a ModuleNotFoundError traceback from deep in the config's imports."""
    run = subprocess.run([sys.executable, "-S", str(ROOT / "launch.py"), "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert run.stderr.startswith(f"launch.py: error: this Python ({sys.executable}) lacks "
                                 "jaxtron's dependencies (jax, "), run.stderr
    assert run.stderr.rstrip().endswith("activate its environment (. .venv/bin/activate) or "
                                        "install them (pip install -e .)")
    assert len(run.stderr.splitlines()) == 1


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "tools").glob("*.py")))
def test_a_tool_run_without_the_environment_says_how_to_get_it(script):
    """`python tools/plot.py --help` with a Python that has not installed jaxtron (here -S: no
    site-packages) was a `No module named 'jaxtron'` traceback; a module that is no command
    (text_inputs.py) printed nothing, run with or without the environment."""
    commands = {Path(s).name for s in MISSING}
    for python in ([sys.executable, "-S"], [sys.executable]):
        if script in commands and len(python) == 1:
            continue  # --help of a command, tested above through its errors
        run = subprocess.run([*python, str(ROOT / "tools" / script), "--help"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert (run.returncode, run.stdout, run.stderr.count("\n")) == (2, "", 1), run.stderr
        if script in commands:
            assert run.stderr == (f"{script}: error: this Python ({sys.executable}) lacks jaxtron; "
                                  "activate its environment (. .venv/bin/activate) or install it "
                                  "(pip install -e .)\n")
        else:
            assert run.stderr.startswith(f"{script}: error: a module ") and re.search(
                r"not a command; run .*python tools/\w+\.py --help", run.stderr), run.stderr
