"""Training curves of one or more runs as PNGs: loss, learning rate, throughput, MFU, grad norm.

    jaxtron plot runs/tiny                         # into runs/tiny/plots/
    jaxtron plot runs/a runs/b --out plots/a_vs_b  # runs compared, one colour each

Reads each run directory's metrics.jsonl (one row per logged step, jaxtron/plan/costs.py KEYS),
eval.jsonl and config.yaml, and writes loss.png (train and eval loss against tokens seen, log
scale), lr.png, throughput.png (tokens/s of the whole job), mfu.png and grad_norm.png (the global
norm before clipping) against the step; prints the paths written. Tokens seen: each row's
`tokens`, the trainer's count (right across a resume that changed the batch or sequence length);
for an evaluation at a step without a row, and rows without the count, carried on at
train.batch_size x train.seq_len per step from config.yaml. A resumed run repeats the steps after
its last checkpoint: the last row of each step counts, so the curves show what the surviving run
did. MFU is skipped with a note when no run has it (devices without a known peak, e.g. CPUs). A
directory without metrics.jsonl: one line on stderr, exit status 2.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from jaxtron import cli
from jaxtron.config import ConfigError
from jaxtron.lifecycle import one_line_errors

# (file stem, metrics key, y label, title, y scale, factor): the curves against the step
STEP_PLOTS = (
    ("lr", "lr", "learning rate", "Learning rate", "linear", 1.0),
    ("throughput", "tokens_per_sec", "tokens/s (all devices)", "Throughput", "linear", 1.0),
    ("mfu", "mfu", "MFU (% of dense BF16 peak)", "Model FLOPs utilisation", "linear", 100.0),
    ("grad_norm", "grad_norm", "global gradient norm (before clipping)", "Gradient norm", "log",
     1.0),
)
PLOTTED = {"loss", "eval_loss", "tokens"} | {key for _, key, *_ in STEP_PLOTS}
FEW = 50  # a series of fewer points gets a marker on each: one point alone is no line at all


class NoRows(ConfigError):
    """A run that has not logged a step yet: the only run given, an error; one of several, a
    note."""


@dataclass(frozen=True)
class Run:
    """One run's logged rows, one per step (the last of a step a restart repeated), by step."""

    name: str
    rows: list[dict]  # metrics.jsonl rows
    evals: list[dict]  # eval.jsonl rows
    tokens_per_step: int

    def series(self, key: str) -> tuple[list[int], list[float | None]]:
        """(steps, values of `key`) over the logged steps."""
        return [r["step"] for r in self.rows], [r.get(key) for r in self.rows]

    def tokens(self, rows: list[dict]) -> list[int]:
        """Tokens seen after each row's step: the count of the last metrics row at or before it,
        plus tokens_per_step for each step since."""
        counted = [(r["step"], r["tokens"]) for r in self.rows if isinstance(r.get("tokens"), int)]
        steps = [step for step, _ in counted]
        seen = []
        for row in rows:
            at = bisect.bisect_right(steps, row["step"]) - 1
            step, tokens = counted[at] if at >= 0 else (0, 0)
            seen.append(tokens + (row["step"] - step) * self.tokens_per_step)
        return seen


# ---------------------------------------------------------------- reading
def read_jsonl(path: Path, need: str) -> list[dict]:
    """The rows of a JSONL file, each with `need`; a last line cut short (the writer was killed)
    is dropped."""
    lines = path.read_text().split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # no newline after it: an unfinished write
                break
            raise ConfigError(f"{path}:{number}: not a JSON row") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ConfigError(f"{path}:{number}: a row without an integer 'step'")
        if need not in row:
            raise ConfigError(f"{path}:{number}: a row without '{need}'")
        for key in PLOTTED & row.keys():
            if not (row[key] is None or isinstance(row[key], (int, float))):
                raise ConfigError(f"{path}:{number}: {key} {row[key]!r} is not a number")
        rows.append(row)
    return rows


def last_per_step(rows: list[dict]) -> list[dict]:
    """One row per step, the one written last (a resumed run rewrites the steps after its
    checkpoint), in step order."""
    return sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])


def tokens_per_step(run_dir: Path, rows: list[dict]) -> int:
    """Global tokens per step: batch_size x seq_len from config.yaml, else from a logged row."""
    config = run_dir / "config.yaml"
    if config.is_file():
        try:
            sections = yaml.safe_load(config.read_text()) or {}
        except yaml.YAMLError:
            sections = None
        if not isinstance(sections, dict):
            raise ConfigError(f"{config}: not a YAML mapping of sections (as a run writes it)")
        train = sections.get("train")
        if isinstance(train, dict) and all(isinstance(train.get(k), int)
                                           for k in ("batch_size", "seq_len")):
            return train["batch_size"] * train["seq_len"]
    row = rows[0]  # tokens_per_sec = tokens per step / step_time
    if not all(isinstance(row.get(k), (int, float)) for k in ("tokens_per_sec", "step_time")):
        raise ConfigError(f"{run_dir}: no config.yaml with train.batch_size and train.seq_len, "
                          "nor tokens_per_sec and step_time logged: the tokens seen are unknown")
    return round(row["tokens_per_sec"] * row["step_time"])


def load_run(run_dir: Path, name: str) -> Run:
    """A run directory's metrics and evaluations, de-duplicated by step."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        what = "is not a directory" if not run_dir.is_dir() else "has no metrics.jsonl"
        raise ConfigError(f"{run_dir} {what}; give a run directory (run.dir of a training run)")
    rows = last_per_step(read_jsonl(metrics, "loss"))
    if not rows:
        raise NoRows(f"{metrics}: no rows yet (the run has not logged a step)")
    evals = run_dir / "eval.jsonl"
    eval_rows = last_per_step(read_jsonl(evals, "eval_loss")) if evals.is_file() else []
    return Run(name, rows, eval_rows, tokens_per_step(run_dir, rows))


def run_names(paths: list[Path]) -> list[str]:
    """Each run's label: its directory name, or the path as given where names clash."""
    names = [p.resolve().name for p in paths]
    return [n if names.count(n) == 1 else str(p) for n, p in zip(names, paths)]


# ---------------------------------------------------------------- figures
def count(value: float, _=None) -> str:
    """Tick label of a count: 1500 -> '1.5K', 3e9 -> '3B'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:g}{unit}"
    return f"{value:g}"


def _plain_log_formatter(minor: bool):
    """Log-axis tick labels as plain numbers (0.6, 8.5; not 6e-01, 8.5 x 10^0), on the ticks
    matplotlib's LogFormatter would label (minor ones only on short ranges)."""
    from matplotlib.ticker import LogFormatter

    class PlainLog(LogFormatter):
        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    return PlainLog(labelOnlyBase=False, minor_thresholds=(2, 0.5)) if minor else PlainLog()


def markers(points: int) -> dict:
    """plot() arguments that mark each point of a short series."""
    return {"marker": "o", "markersize": 4} if points < FEW else {}


def _axes(title: str, xlabel: str, ylabel: str, yscale: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    ax.set_title(title, fontsize=14)
    ax.set_xlabel(xlabel, fontsize=12)
    ax.set_ylabel(ylabel, fontsize=12)
    ax.tick_params(labelsize=10, which="both")
    ax.set_yscale(yscale)
    if yscale == "log":  # plain numbers (8.5, not 8.5 x 10^0); minor ticks labelled on short ranges
        ax.yaxis.set_major_formatter(_plain_log_formatter(minor=False))
        ax.yaxis.set_minor_formatter(_plain_log_formatter(minor=True))
    ax.grid(True, which="both", alpha=0.3)
    return fig, ax


def loss_figure(runs: list[Run]):
    """Train loss (lines) and eval loss (dashed, markers) against tokens seen, log y."""
    from matplotlib.ticker import FuncFormatter

    fig, ax = _axes("Loss", "tokens seen", "loss (nats per token)", "log")
    for i, run in enumerate(runs):
        colour = f"C{i % 10}"
        ax.plot(run.tokens(run.rows), [r["loss"] for r in run.rows], color=colour,
                label=f"{run.name} train", **markers(len(run.rows)))
        if run.evals:
            ax.plot(run.tokens(run.evals), [r["eval_loss"] for r in run.evals], color=colour,
                    linestyle="--", marker="o", label=f"{run.name} eval")
    ax.xaxis.set_major_formatter(FuncFormatter(count))
    ax.legend(fontsize=10)
    return fig


def step_figure(runs: list[Run], key: str, ylabel: str, title: str, yscale: str, factor: float):
    """`key` against the step, one line per run; None when no run logged a value of it."""
    from matplotlib.ticker import FuncFormatter

    fig, ax = _axes(title, "step", ylabel, yscale)
    largest = None
    for i, run in enumerate(runs):
        steps, values = run.series(key)
        points = [(s, v * factor) for s, v in zip(steps, values) if v is not None]
        if points:
            ax.plot(*zip(*points), color=f"C{i % 10}", label=run.name, **markers(len(points)))
            largest = max(largest or 0.0, max(abs(v) for _, v in points))
    if largest is None:
        import matplotlib.pyplot as plt

        plt.close(fig)
        return None
    if yscale == "linear" and largest >= 1e4:  # 1.2M rather than 1.2 with a 1e6 offset
        ax.yaxis.set_major_formatter(FuncFormatter(count))
    ax.legend(fontsize=10)
    return fig


def figures(runs: list[Run]) -> tuple[dict, list[str]]:
    """{file stem: Figure} of every plot that has data, and notes on those skipped."""
    import matplotlib

    matplotlib.use("Agg")
    made, notes = {"loss": loss_figure(runs)}, []
    for stem, key, ylabel, title, yscale, factor in STEP_PLOTS:
        fig = step_figure(runs, key, ylabel, title, yscale, factor)
        if fig is None:
            why = " (null on devices without a known peak, e.g. CPUs)" if key == "mfu" else ""
            notes.append(f"skipped {stem}.png: no run logged {key}{why}")
        else:
            made[stem] = fig
    return made, notes


# ---------------------------------------------------------------- command line
def plot(paths: list[Path], out: Path | None) -> None:
    """Load the runs, write the PNGs into `out` (default: the first run's plots/), print them."""
    import matplotlib.pyplot as plt

    runs, skipped = [], []
    for path, name in zip(paths, run_names(paths)):
        try:
            runs.append(load_run(path, name))
        except NoRows as e:
            if len(paths) == 1:
                raise
            skipped.append(f"skipped {name}: {e}")
    if not runs:
        raise ConfigError(f"none of the {len(paths)} runs has logged a step yet")
    out = out or paths[0] / "plots"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory")
    try:  # before drawing; only after the runs read, so that a bad run leaves no directory
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot make --out {out}: {e.strerror}") from None
    cli.writable_file(out / "loss.png", "--out")
    made, notes = figures(runs)
    for note in skipped + notes:
        print(note)
    for stem, fig in made.items():
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=110)
        plt.close(fig)
        print(out / f"{stem}.png")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = cli.Parser(command="tools/plot.py", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (run.dir)")
    parser.add_argument("--out", type=Path, help="directory for the PNGs (default RUN/plots)")
    args = parser.parse_args(argv)
    return one_line_errors(lambda: plot(args.runs, args.out))

