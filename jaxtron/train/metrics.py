"""The metric writers of a training run: each logged step to stdout (a progress bar or lines),
metrics.jsonl and TensorBoard, and the stopwatch whose spans the goodput account and the step
times are made of. The row itself is jaxtron/plan/costs.py's make_row."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

BAR_DROPS = ("ms", "lr", "grad_norm", "tok")  # what the progress bar drops first when narrow


class MetricsWriter:
    """Writes each logged step to stdout (progress bar or lines), metrics.jsonl and TensorBoard."""

    def __init__(self, run_dir: Path, total_steps: int, progress: str, tensorboard: bool,
                 is_main: bool = True):
        self.is_main = is_main
        self.paths = (run_dir / "metrics.jsonl", run_dir / "eval.jsonl")
        self.jsonl, self.eval_jsonl = (p.open("a") if is_main else None for p in self.paths)
        self.tb = None
        self.tb_dir = run_dir / "tensorboard" if is_main and tensorboard else None
        if self.tb_dir is not None:
            import logging

            # It warns "NaN or Inf found in input tensor" per NaN scalar: twice a skipped step,
            # which the step's own line already reports.
            logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        self.total_steps = total_steps
        self.use_bar = is_main and (progress == "bar" or (progress == "auto"
                                                          and sys.stdout.isatty()))
        self.bar = None
        self.logged = 0  # the last logged step

    def begin(self, start: int) -> None:
        """The loop starts after step `start`. Rows of later steps, from earlier attempts, are
        dropped (they are being redone) and TensorBoard hides their events; the bar (if any)
        counts from `start`, so its rate and time left are this attempt's."""
        if not self.is_main:
            return
        self.jsonl.close()
        self.eval_jsonl.close()
        for path in self.paths:
            drop_after(path, start)
        self.jsonl, self.eval_jsonl = (path.open("a") for path in self.paths)
        self._board(purge_step=start + 1)  # nothing is written to TensorBoard before this
        if self.use_bar:
            columns, rows = terminal_shape(sys.stderr)
            self.bar = _step_bar(total=self.total_steps, initial=start, unit="step",
                                 ncols=columns, nrows=rows)
        self.logged = start

    def _board(self, purge_step: int | None = None):
        """The TensorBoard writer, made on first use; `purge_step` makes TensorBoard hide what
        earlier event files logged at that step and after (an attempt's redone steps)."""
        if self.tb is None and self.tb_dir is not None:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(self.tb_dir), purge_step=purge_step)
        return self.tb

    def tick(self, step: int) -> None:
        """Step `step` was dispatched: move the bar (no device sync)."""
        if self.bar is not None:
            self._fit_bar()
            self.bar.update(step - self.bar.n)

    def _fit_bar(self) -> None:
        """Follow the terminal's size, as tqdm's dynamic_ncols would, but never 0 or less."""
        self.bar.ncols, self.bar.nrows = terminal_shape(self.bar.fp)

    def info(self, message: str, every_process: bool = False) -> None:
        """A plain line on stdout, with the time (above the progress bar if there is one); from
        process 0, or with `every_process` from each (a line that differs between processes)."""
        if not self.is_main and not every_process:
            return
        line = f"{time.strftime('%H:%M:%S')} {message}"
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def write(self, row: dict) -> None:
        """Record one logged step; `row` has KEYS (make_row), and with model.fp8 its statistics."""
        if not self.is_main:
            return
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        if self._board() is not None:
            for key, value in row.items():
                if key != "step" and value is not None:
                    self.tb.add_scalar(f"train/{key}", value, row["step"])
            self.tb.flush()  # on disk with its JSONL row (tensorboardX holds events up to 120 s)
        if self.bar is not None:
            self._fit_bar()
            steps, seconds = self.bar.trained
            self.bar.trained = (steps + row["step"] - self.logged,
                                seconds + row["step_time"] * (row["step"] - self.logged))
            self.bar.update(row["step"] - self.bar.n)
            self.bar.set_postfix_str(self._postfix(row))
        else:
            self.info(format_row(row))
        self.logged = row["step"]

    def _postfix(self, row: dict) -> str:
        """The row's fields that fit beside the bar (left 4 columns or more), the least telling
        dropped first: ms/step (the bar shows s/step), lr, grad_norm, tok/s; none is cut
        mid-number (tqdm cuts a line past the terminal's width)."""
        fields = {"loss": f"loss {row['loss']:.4f}", "lr": f"lr {row['lr']:.2e}",
                  "grad_norm": f"grad_norm {row['grad_norm']:.3f}",
                  "ms": f"{row['step_time'] * 1e3:.0f} ms/step",
                  "tok": f"{row['tokens_per_sec']:,.0f} tok/s"}
        for dropped in range(len(fields)):
            kept = [v for k, v in fields.items() if k not in BAR_DROPS[:dropped]]
            postfix = " | ".join(kept)
            meter = self.bar.format_meter(**{**self.bar.format_dict, "ncols": None,
                                             "postfix": postfix})  # its bar is 10 columns
            if self.bar.ncols is None or len(meter) - 10 + 4 <= self.bar.ncols:
                break
        return postfix

    def write_eval(self, step: int, loss: float) -> None:
        """Record one evaluation on the held-out split: loss (nats) and perplexity."""
        if not self.is_main:
            return
        row = {"step": step, "eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}
        self.eval_jsonl.write(json.dumps(row) + "\n")
        self.eval_jsonl.flush()
        if self._board() is not None:
            self.tb.add_scalar("eval/loss", row["eval_loss"], step)
            self.tb.add_scalar("eval/perplexity", row["eval_perplexity"], step)
            self.tb.flush()
        self.info(f"eval   {step:>6} | loss {loss:.4f} | perplexity {row['eval_perplexity']:.2f}")

    def scalar(self, name: str, value: float, step: int) -> None:
        """An extra TensorBoard scalar (timings that are not per-step metrics)."""
        if self._board() is not None:
            self.tb.add_scalar(name, value, step)

    def scalars(self, prefix: str, values: dict[str, float], step: int) -> None:
        """Extra TensorBoard scalars `prefix/<key>` (the goodput account of run.dir's attempts)."""
        for key, value in values.items():
            self.scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for f in (self.jsonl, self.eval_jsonl):
            if f is not None:
                f.close()
        if self.tb is not None:
            self.tb.close()


def drop_after(path: Path, step: int) -> None:
    """Drop a JSONL log's rows of steps after `step` (an earlier attempt's, being redone) and a
    last line a kill cut short; the file is replaced atomically, the other lines kept as they
    are."""
    if not path.exists():
        return
    lines = path.read_bytes().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            logged = json.loads(line).get("step")
        except (ValueError, AttributeError):
            logged = None  # not a row: kept, unless a kill cut it short
        if logged is not None and logged <= step:
            kept.append(line if line.endswith(b"\n") else line + b"\n")
        elif logged is None and line.endswith(b"\n"):
            kept.append(line)
    if kept == lines:
        return
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(b"".join(kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _step_bar(**kwargs):
    """A tqdm bar whose final rate (drawn at close) is the logged steps' own, from their rows'
    step_time, rather than tqdm's steps over elapsed time, which counts evaluations, checkpoint
    waits and the run's end (a 2.3 s step showed as 3.9 s/step)."""
    from tqdm import tqdm

    class StepBar(tqdm):
        trained = (0, 0.0)  # steps and seconds of the rows logged so far

        @property
        def format_dict(self) -> dict:
            values = super().format_dict
            if values["rate"] is None and self.trained[1] > 0:  # at close: no moving average
                values["rate"] = self.trained[0] / self.trained[1]
            return values

    return StepBar(**kwargs)


def terminal_shape(stream) -> tuple[int | None, int | None]:
    """Columns and rows for the progress bar on `stream`: one less than its terminal's (a full last
    column wraps), None on a stream that is no terminal (tqdm's defaults). A terminal that reports
    0x0 (some CI and ssh set-ups; tqdm took it as -1x-1 and drew no bar at all) gets $COLUMNS and
    $LINES, else 80x24."""
    try:
        columns, rows = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):
        return None, None
    if columns <= 1 or rows <= 1:  # a bar needs a column after the -1
        fallback = shutil.get_terminal_size()  # $COLUMNS and $LINES, then stdout, then 80x24
        columns = columns if columns > 1 else fallback.columns
        rows = rows if rows > 1 else fallback.lines
    return (columns if columns > 1 else 80) - 1, (rows if rows > 1 else 24) - 1


def format_row(row: dict) -> str:
    """One human-readable log line."""
    mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    if row.get("mfu_fp8") is not None:
        mfu += f" ({100 * row['mfu_fp8']:.1f}% of the FP8 peak)"
    tflops = "n/a" if row["tflops_per_device"] is None else f"{row['tflops_per_device']:.2f}"
    return (
        f"step {row['step']:>6} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
        f"grad_norm {row['grad_norm']:.3f} | {row['tokens_per_sec']:,.0f} tok/s | "
        f"step {1000 * row['step_time']:.1f} ms | {tflops} TFLOP/s/dev | MFU {mfu}"
        + _moe_part(row)
    )


def _moe_part(row: dict) -> str:
    """' | aux 2.01 | load 1.38' for a mixture of experts (and dropped, with a capacity)."""
    if "moe_aux_loss" not in row:
        return ""
    part = f" | aux {row['moe_aux_loss']:.3f} | load {row['moe_load']:.2f}"
    if "mtp_loss" in row:
        part += f" | mtp {row['mtp_loss']:.4f}"
    return part + (f" | dropped {100 * row['moe_dropped']:.1f}%" if "moe_dropped" in row else "")


class Stopwatch:
    """Accumulates wall time of named phases (compile, data wait, checkpoint, eval); the goodput
    account (jaxtron/train/goodput.py) is built from these totals."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.totals: dict[str, float] = {}
        self.last = 0.0  # duration of the most recent span

    @contextlib.contextmanager
    def time(self, name: str):
        """Time the enclosed block as `name`; also when it raises (a preemption or an error
        mid-phase still counts in the account)."""
        start = self.clock()
        try:
            yield
        finally:
            self.last = self.clock() - start
            self.totals[name] = self.totals.get(name, 0.0) + self.last


class StepWindow:
    """The training time of the steps since the last logged row: their wall time less the
    Stopwatch's spans that are not training (checkpoint saves, evaluations, the profiler). The loop
    waits for the last step's device work before each such span, so that work stays in its row."""

    NOT_TRAINING = ("checkpoint", "eval", "profile")

    def __init__(self, watch: Stopwatch, step: int):
        self.watch = watch
        self._open(step)

    def _not_training(self) -> float:
        return sum(self.watch.totals.get(name, 0.0) for name in self.NOT_TRAINING)

    def _open(self, step: int) -> None:
        self.step, self.start, self.excluded = step, self.watch.clock(), self._not_training()

    def close(self, step: int) -> float:
        """Seconds per step over steps after the last row's to `step` (call once `step` has
        finished); the next window opens now."""
        seconds = self.watch.clock() - self.start - (self._not_training() - self.excluded)
        per_step = seconds / (step - self.step)
        self._open(step)
        return per_step
