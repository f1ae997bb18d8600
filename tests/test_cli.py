"""Every command's bad input ends the same way: one line `<script>: error: <message>` on stderr
(argparse's own form, <script> the file run), nothing on stdout, exit status 2. Run as users run
them, each with a missing file (the command's own check) and an unknown flag (argparse's)."""

import importlib
import os
import re
import signal
import subprocess
import sys
import time
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
    "tools/plan.py": ["--devices", "8", "--config", "nope.yaml"],
    "tools/plot.py": ["nope"],
    "tools/prepare_data.py": ["nope.txt", "--out", "ds", "--tokenizer", "nope.model"],
}


def test_every_command_is_listed():
    """launch.py, and each command of `jaxtron` with its shim in tools/ (none without the other)."""
    from jaxtron.commands import COMMANDS

    shims = {str(p.relative_to(ROOT)) for p in [ROOT / "launch.py", *ROOT.glob("tools/*.py")]
             if "sys.exit(run(" in p.read_text()}
    assert shims == {c.shim for c in COMMANDS.values()} == set(MISSING)
    for name, command in COMMANDS.items():
        assert f'sys.exit(run("{name}"))' in (ROOT / command.shim).read_text()


def test_the_jaxtron_command_names_its_commands(capsys):
    """`jaxtron` alone, or with a command it lacks: one line and status 2, the nearest command
    suggested; --help lists them all."""
    from jaxtron.commands import COMMANDS, main

    assert main([]) == 2
    assert capsys.readouterr().err.startswith("jaxtron: error: a command is needed; one of ")
    assert main(["prepare_data"]) == 2  # the shim's spelling
    assert capsys.readouterr() == ("", "jaxtron: error: no command 'prepare_data'; did you mean "
                                       "prepare-data? (see jaxtron --help)\n")
    assert main(["xyzzy"]) == 2
    assert "no command 'xyzzy'; one of train, prepare-data, " in capsys.readouterr().err
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in COMMANDS)


def test_each_jaxtron_command_names_itself_in_its_errors(tmp_path):
    """`jaxtron NAME --no-such-flag` (here `python -m jaxtron.commands`, the console script's
    code without its install): the line and its --help hint name `jaxtron NAME`, status 2."""
    from jaxtron.commands import COMMANDS

    runs = {name: subprocess.Popen([sys.executable, "-m", "jaxtron.commands", name,
                                    *MISSING[c.shim], "--no-such-flag"],
                                   cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
            for name, c in COMMANDS.items()}
    for name, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert (run.returncode, out) == (2, ""), err
        assert err.startswith(f"jaxtron {name}: error: unrecognized arguments: --no-such-flag")
        assert err.endswith(f"(see jaxtron {name} --help)\n"), err
    assert list(tmp_path.iterdir()) == []


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


def _stop_during_compile(tmp_path, sig):
    """bench.py on the tiny preset (one CPU device), sent `sig` once XLA has begun compiling the
    train step (its dump of the step appears as the compile starts; the compile takes seconds)."""
    dump = tmp_path / "hlo"
    one_device = {**os.environ, "XLA_FLAGS": ""}  # as a user runs it: there the crash is certain
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "bench.py"), "--steps", "10",
                             f"xla.flags=[--xla_dump_to={dump}]"], cwd=ROOT, text=True,
                            env=one_device, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not list(dump.glob("*jit_train_step*")) and proc.poll() is None:
        assert time.monotonic() < deadline, "the train step's compile never started"
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=240)
    return proc.returncode, out, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_compile_is_one_line_and_status_130(tmp_path, sig):
    """Ctrl-C during bench.py's compile was a KeyboardInterrupt traceback, then a crash in XLA's
    threads at the interpreter's exit (status 139); SIGTERM killed it without a word."""
    assert _stop_during_compile(tmp_path, sig) == (130, "", "bench.py: stopped by a signal\n")


def test_a_stop_is_one_line_in_process_and_left_to_a_command_that_handles_signals(capsys):
    """Called in-process, one_line_errors returns 130 after its line; a command with a SIGINT
    handler of its own (launch.py, prepare_data.py) gets its KeyboardInterrupt back."""
    from jaxtron import lifecycle

    def stop():
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own (conftest restores)
    assert lifecycle.one_line_errors(stop) == 130
    assert capsys.readouterr() == ("", f"{lifecycle.script_name()}: stopped by a signal\n")
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        with pytest.raises(KeyboardInterrupt):
            lifecycle.one_line_errors(stop)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr() == ("", "")



def test_a_stop_goes_back_to_a_command_whose_own_handler_is_on_sigterm_only():
    """A job a script starts with `&` begins with SIGINT ignored: launch.py's handler is then on
    SIGTERM alone, and its KeyboardInterrupt (75) became `stopped by a signal` and 130."""
    from jaxtron import lifecycle

    def stop():
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # conftest restores both
    signal.signal(signal.SIGTERM, lambda *_: None)
    with pytest.raises(KeyboardInterrupt):
        lifecycle.one_line_errors(stop)

PROBE = """
import os, signal, sys, time
sys.path.insert(0, {tools!r})
import _environment  # as every command of tools/ starts
from jaxtron import cli, lifecycle
from jaxtron.config import ConfigError

def work():
    if sys.argv[1] == "in-a-gc-callback":  # jax runs one at every garbage collection
        import gc

        def callback(phase, info):
            if phase == "start":
                os.kill(os.getpid(), signal.{sig})
                [i for i in range(3)]  # a call: the handler runs here, inside the callback
        gc.callbacks.append(callback)
        gc.collect()
        gc.callbacks.remove(callback)
        time.sleep(1)
        print("not stopped")
        return 0
    raise ConfigError("a bad value")

if __name__ == "__main__":
    cli.Parser(command="probe.py").parse_args([])
    if sys.argv[1] == "while-importing":
        os.kill(os.getpid(), signal.{sig})  # as if jax were still importing
        time.sleep(0.2)
    status = lifecycle.one_line_errors(work)
    if sys.argv[1] == "while-exiting":
        os.kill(os.getpid(), signal.{sig})  # the line is out; the interpreter is ending
        time.sleep(0.2)
    sys.exit(status)
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("when, status, line", [
    ("while-importing", 130, "probe.py: stopped by a signal\n"),
    ("while-exiting", 2, "probe.py: error: a bad value\n"),
    ("in-a-gc-callback", 130, "probe.py: stopped by a signal\n"),
])
def test_a_signal_before_or_after_the_work_is_one_line(tmp_path, sig, when, status, line):
    """A command of tools/ stopped while it imported (jax: a second or two) was a KeyboardInterrupt
    traceback, or an ImportError from inside jaxlib; one stopped after its line, while the
    interpreter ended, exited -2 instead of its status; one whose signal landed in a garbage
    collection's callback printed "Exception ignored ... KeyboardInterrupt" and went on (exit 0)."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE.format(tools=str(ROOT / "tools"), sig=sig))
    run = subprocess.run([sys.executable, str(probe), when], cwd=tmp_path, text=True,
                         capture_output=True, timeout=120)
    assert (run.returncode, run.stdout, run.stderr) == (status, "", line)


@pytest.mark.parametrize("delay", [0.3, pytest.param(0.8, marks=pytest.mark.slow)])
def test_ctrl_c_while_a_tool_imports_jax_is_one_line(delay):
    """plan.py imports jax at its top, for about two seconds; Ctrl-C there is its one line."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "plan.py"), "--config",
                             str(ROOT / "configs" / "llama3_8b.yaml"), "--devices", "8"], cwd=ROOT,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, out, err) == (130, "", "plan.py: stopped by a signal\n")


@pytest.mark.skipif(os.path.exists("/proc/driver/nvidia"), reason="a GPU: cuda starts here")
@pytest.mark.parametrize("script, args", [
    ("tools/generate.py", ["{tmp}", "--prompt", "x"]),
    ("tools/commbench.py", ["mesh.fsdp=8"]),
])
def test_a_backend_that_cannot_start_is_one_line_in_the_tools(tmp_path, script, args):
    """JAX_PLATFORMS=cuda without a GPU was an AssertionError traceback from jax (status 1)."""
    proc = subprocess.run([sys.executable, str(ROOT / script),
                           *(a.format(tmp=tmp_path) for a in args)], cwd=ROOT, text=True,
                          capture_output=True, timeout=300, env={**os.environ,
                                                                 "JAX_PLATFORMS": "cuda"})
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", (
        f"{Path(script).name}: error: JAX_PLATFORMS=cuda, but no cuda backend starts here (no "
        "NVIDIA GPU visible); pip install -e '.[cuda12]' on a GPU machine, or unset "
        "JAX_PLATFORMS\n"))


@pytest.mark.parametrize("tokens", ["1,2,,3", "1,2,", ",1", ""])
def test_generate_refuses_an_empty_token_id(tokens):
    """`--tokens 1,2,,3` was read as 1,2,3."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "generate.py"), "nope",
                           "--tokens", tokens], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", (
        f"generate.py: error: argument --tokens: '{tokens}' is not a list of token ids (0 or "
        "more), such as 1,2,3 (see python tools/generate.py --help)\n"))


def test_generate_reads_token_ids_with_spaces_around_commas():

    generate = importlib.import_module("jaxtron.commands.generate")
    assert generate.token_ids(" 1 , 2,3 ") == [1, 2, 3]


def test_launch_says_the_statuses_of_the_lifecycle_table():
    """launch.py keeps its own 75 (a stop may come before jaxtron imports): the table's."""
    import launch
    from jaxtron import lifecycle

    assert launch.EXIT_PREEMPTED == lifecycle.EXIT_PREEMPTED == lifecycle.EXIT_LOST_PEER == 75
    assert len({lifecycle.EXIT_USAGE, lifecycle.EXIT_NONFINITE, lifecycle.EXIT_SAVE_FAILED,
                lifecycle.EXIT_PREEMPTED, lifecycle.EXIT_STOPPED, 0, 1}) == 7


@pytest.mark.parametrize("script, args, hint", [
    ("tools/plan.py", ["--gpus", "64"], "; --gpus is --devices here"),  # a required one missing
    ("tools/plan.py", ["--devices", "8", "--gpus-per-node", "8"], "; --gpus-per-node is --gpus-per-host here"),
    ("launch.py", ["--dry-run", "--gpus", "8"], "; --gpus is --devices here"),  # no abbreviation
    ("launch.py", ["--dry-rn"], "; did you mean --dry-run?"),
    ("tools/doctor.py", ["--devics", "8"], "; did you mean --devices?"),
    ("launch.py", ["--bogus"], " (see python launch.py --help)"),  # nothing near: no guess
])
def test_a_wrong_option_is_told_its_name_here(script, args, hint):
    """Every command names the devices of the job --devices and the GPUs per host
    --gpus-per-host; another framework's name, or a typo, gets the one it has here."""
    proc = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=300)
    line = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in line and "error:" in line, proc.stderr
    assert hint in line and ("did you mean" in hint or " is " in hint or "did you" not in line)
